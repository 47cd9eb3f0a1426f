"""``oscar_export/outputs.py``: what ``build`` serves of an exported checkpoint: its own files, regular ones, checked
on the descriptor that is copied, and no remote code."""

from __future__ import annotations

import json
import time

import pytest

from oscar_export.cli import main

from helpers import one_line, own_copy


def test_build_refuses_a_symlink_loop_before_compiling(exported_ckpt, tmp_path, capsys, monkeypatch):
    """A symlink loop (``ln -s . ckpt/loop``) is refused before build compiles or copies anything."""
    import oscar_export.kernels.aot.compile as compile_mod

    monkeypatch.setattr(compile_mod, "build_bundle", lambda *a, **k: pytest.fail("compiled before the checks"))
    d = own_copy(exported_ckpt, tmp_path / "ckpt")
    (d / "loop").symlink_to(".")
    t0 = time.perf_counter()
    assert main(["build", "--export", str(d), "--out", str(tmp_path / "deploy"), "--arch", "sm_90"]) == 2
    assert time.perf_counter() - t0 < 5
    err = one_line(capsys.readouterr().err, "build")
    assert "loop: a symbolic link in the checkpoint" in err and "regular files only" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_build_serves_only_the_checkpoint_and_no_remote_code(exported_ckpt, tmp_path, capsys, fake_bundle):
    """The served checkpoint holds no live remote code (a config.json auto_map with its modeling_*.py) and no stray
    file."""
    d = own_copy(exported_ckpt, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling_evil.py").write_text("import os  # runs with trust_remote_code\n")
    with open(d / "stray.bin", "wb") as f:
        f.truncate(50 << 20)  # a sparse 50 MB file: costs no disk here, would be copied byte for byte
    (d / "oscar_artifact" / "notes.txt").write_text("x")
    assert main(["build", "--export", str(d), "--out", str(tmp_path / "deploy"), "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "left out of" in out and "modeling_evil.py" in out and "stray.bin" in out, out
    served = tmp_path / "deploy" / "checkpoint"
    assert sorted(p.name for p in served.rglob("*")) == sorted(
        ["config.json", "model.safetensors", "oscar_artifact", "oscar.json", "rotations.safetensors"]
        + [p.name for p in exported_ckpt.iterdir() if p.name == "generation_config.json"])
    assert "auto_map" not in json.loads((served / "config.json").read_text())
    deploy = json.loads((tmp_path / "deploy" / "deploy.json").read_text())
    assert deploy["left_out_of_checkpoint"] == [".oscar-output", "modeling_evil.py", "oscar_artifact/notes.txt",
                                                "stray.bin"]


def test_a_file_swapped_while_build_reads_it_is_refused(tmp_path):
    """Checked on the descriptor that is copied: a file replaced by a link, or grown, after it was listed."""
    from oscar_export.outputs import checkpoint_files, copy_checkpoint

    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "secret").write_bytes(b"s" * 100)
    files, left = checkpoint_files(src)
    assert files == {"config.json": 2, "model.safetensors": 100} and left == []
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to(tmp_path / "secret")  # same size, outside: O_NOFOLLOW refuses it
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        copy_checkpoint(src, files, tmp_path / "a")
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").write_bytes(b"x" * 200)
    with pytest.raises(ValueError, match="changed while build read the checkpoint"):
        copy_checkpoint(src, files, tmp_path / "b")

