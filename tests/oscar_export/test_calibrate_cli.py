"""`oscar-export calibrate` / `inspect` argument and input errors: one line, exit code 2, before any model load."""

from __future__ import annotations

import json
import re

import pytest

from oscar_export.cli import main


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--tokens", "100"], "100 tokens make 0 sequences of 512"),
        (["--seq-len", "100"], "seq_len: expected >= sink \\+ page_size = 128, got 100"),
        (["--heldout", "0"], "heldout and batch_size must be >= 1"),
        (["--model", "/nonexistent/model"], "expected 'default' or a local Hugging Face model directory"),
    ],
)
def test_calibrate_bad_inputs(tmp_path, capsys, argv, msg):
    rc = main(["calibrate", "--out", str(tmp_path / "a"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert re.search(msg, err), err


def test_calibrate_bad_choice(tmp_path):
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", str(tmp_path), "--key-granularity", "row"])


def test_inspect_bad_inputs(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "oscar.json is missing" in capsys.readouterr().err
    (tmp_path / "oscar.json").write_text("[]")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "expected format 'oscar-kv-artifact'" in capsys.readouterr().err


def test_inspect_identity_artifact(tmp_path, capsys):
    from transformers import LlamaConfig

    from oscar_export.calibration.artifact import OscarArtifact

    art = OscarArtifact.identity(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             num_hidden_layers=2, head_dim=16, vocab_size=10))
    art.save(tmp_path)
    assert main(["inspect", str(tmp_path), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "2 layers" in out and f"INT2 part {art.bits_per_element():.3f}" in out, out
    assert out.count("\n    1 |") == 1  # the per-layer table
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bits_per_element"]["int2"] == round(art.bits_per_element(), 4) and len(info["layers"]) == 2
