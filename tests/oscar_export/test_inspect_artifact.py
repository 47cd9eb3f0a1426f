"""``oscar_export/inspect_artifact.py`` (``oscar-export inspect``): the summary, per-layer table and JSON of an
artifact, its per-layer key widths, and a hostile artifact's text escaped, wrong types survived, deep nesting one
line."""

from __future__ import annotations

import json

import pytest

from oscar_export.cli import main

from helpers import identity_artifact_with_stats


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


def _inspect_artifact(tmp_path, **edits):
    art = identity_artifact_with_stats()
    for k, v in edits.items():
        getattr(art, k).clear()
        getattr(art, k).update(v)
    art.save(tmp_path)
    return tmp_path


def test_inspect_escapes_terminal_sequences(tmp_path, capsys):
    evil = "\x1b[2J\x1b]0;owned\x07"
    d = _inspect_artifact(tmp_path, config={"method": evil, evil: 1})
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J" in out, out


@pytest.mark.parametrize(
    "stats",
    [{"layers": [1, "x"]}, {"layers": [{"k": [], "v": None}, {"k": {"rotation": 5, "clip": "x"}}]},
     {"layers": "all"}, {"layers": [{"k": {"vs_identity": "0.5", "vs_hadamard": [1]}, "v": {}}] * 2}],
    ids=["ints", "wrong-sides", "string", "wrong-ratios"],
)
def test_inspect_survives_wrong_types(tmp_path, capsys, stats):
    d = _inspect_artifact(tmp_path, stats=stats)
    for flags in ([], ["--layers"], ["--json"]):
        rc = main(["inspect", str(d), *flags])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        assert "Traceback" not in captured.err


def test_inspect_deep_nesting_is_one_line(tmp_path, capsys):
    d = _inspect_artifact(tmp_path)
    meta = (d / "oscar.json").read_text().replace('"config": {', '"config": {"x": ' + "[" * 5000 + "]" * 5000 + ",", 1)
    (d / "oscar.json").write_text(meta)
    assert main(["inspect", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nested deeper than" in err, err


def test_inspect_shows_per_layer_key_bits(tmp_path, capsys):
    from transformers import LlamaConfig

    from oscar_export.calibration.artifact import OscarArtifact

    art = OscarArtifact.identity(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             num_hidden_layers=3, head_dim=16, vocab_size=10)).with_key_bits([2, 4, 4])
    art.save(tmp_path)
    assert main(["inspect", str(tmp_path), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "key bits   2-bit keys except 2 of 3 layers at [4] bits: layers [1, 2]" in out, out
    assert f"INT2 part {art.bits_per_element():.3f}" in out and out.count(" K4\n") == 2, out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["key_bits"] == [2, 4, 4]
