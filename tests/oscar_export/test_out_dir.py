"""``oscar_export/out_dir.py``: what ``--out`` may be, directly and through the commands: an --out that is,
contains or lies inside an input refused, --force replacing only the tool's own output, a second run to the same
--out refused at once, an --out that cannot be created refused before the model loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from oscar_export.cli import main
from oscar_export.out_dir import MARKER, OutputBusy, check_out_dir

from helpers import files, one_line

ROOT = Path(__file__).resolve().parents[2]


def test_force_refuses_a_directory_that_is_not_an_output(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    (home / "oscar.json").write_text("{}")  # the right file name is not enough: only the tool's own marker is
    with pytest.raises(FileExistsError, match="does not look like .*no .oscar-output marker of a oscar.json output"
                                              ".*refusing to replace it"):
        check_out_dir(home, force=True, looks_like="oscar.json")
    assert (home / "thesis.tex").exists()


def test_out_is_a_file_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="--out .*f: exists and is not a directory"):
        check_out_dir(tmp_path / "f", force=True, looks_like="oscar.json")


@pytest.mark.parametrize("where", ["is", "inside", "around"])
@pytest.mark.parametrize("force", [False, True], ids=["", "force"])
def test_export_out_overlapping_the_model_is_refused(model_dir, art_dir, capsys, no_model_load, where, force):
    out = {"is": model_dir, "inside": model_dir / "sub", "around": model_dir.parent}[where]
    before = files(model_dir)
    t0 = time.perf_counter()
    argv = ["export", "--model", str(model_dir), "--artifact", str(art_dir), "--out", str(out)] + ["--force"] * force
    rc = main(argv)
    assert rc == 2 and time.perf_counter() - t0 < 5
    err = one_line(capsys.readouterr().err, "export")
    why = {"is": "is", "inside": "lies inside", "around": "contains"}[where]
    assert f"{why} the input --model" in err or (where == "around" and "the input --artifact" in err), err
    assert files(model_dir) == before


@pytest.mark.parametrize("force", [False, True], ids=["", "force"])
def test_export_out_is_the_artifact_refused(art_dir, tmp_path, capsys, no_model_load, force):
    before = files(art_dir)
    assert main(["export", "--artifact", str(art_dir), "--out", str(art_dir)] + ["--force"] * force) == 2
    assert "is the input --artifact" in one_line(capsys.readouterr().err, "export")
    assert files(art_dir) == before


def test_build_out_inside_the_export_refused(tmp_path, capsys):
    exp = tmp_path / "ckpt"
    exp.mkdir()
    assert main(["build", "--export", str(exp), "--out", str(exp / "deploy")]) == 2
    assert "lies inside the input --export" in one_line(capsys.readouterr().err, "build")
    assert list(exp.iterdir()) == []


def test_calibrate_force_replaces_only_its_own_output(tmp_path, capsys, no_model_load):
    """An ``oscar.json`` beside the user's files is not enough for --force: only the tool's marker is."""
    out = tmp_path / "art"
    out.mkdir()
    (out / "oscar.json").write_text("{}")
    (out / "thesis.tex").write_text("years of work")
    before = files(out)
    t0 = time.perf_counter()
    assert main(["calibrate", "--out", str(out), "--force", "--quiet"]) == 2
    assert time.perf_counter() - t0 < 5
    err = one_line(capsys.readouterr().err, "calibrate")
    assert f"no {MARKER} marker" in err and "refusing to replace it even with --force" in err, err
    assert files(out) == before


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from oscar_export.atomic_dir import atomic_dir
    with atomic_dir(Path(sys.argv[1]), looks_like="config.json") as tmp:
        (tmp / "config.json").write_text("first")
        print("ready", flush=True)
        sys.stdin.readline()
""")


def test_a_second_run_to_the_same_out_refuses_at_once(tmp_path, art_dir, capsys, no_model_load):
    """Of two exports to one --out at once, the second refuses at once instead of replacing the first's output."""
    out = tmp_path / "ckpt"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "ready"
        with pytest.raises(OutputBusy, match=rf"--out .*ckpt: another oscar-export run \(pid {p.pid}\) is writing"):
            check_out_dir(out, claim=True)
        t0 = time.perf_counter()
        assert main(["export", "--artifact", str(art_dir), "--out", str(out)]) == 2
        assert time.perf_counter() - t0 < 5
        assert "another oscar-export run" in one_line(capsys.readouterr().err, "export")
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
    assert (out / "config.json").read_text() == "first"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["art", "ckpt"], "the lock file is removed at the end"


@pytest.mark.parametrize("out", ["/sys/x", "/proc/x", "/dev/null/x"])
def test_calibrate_unwritable_out_refused_before_the_model_loads(out, capsys, no_model_load):
    if not Path(out).parent.exists():
        pytest.skip(f"{Path(out).parent} does not exist here")
    t0 = time.perf_counter()
    assert main(["calibrate", "--out", out, "--quiet"]) == 2
    assert time.perf_counter() - t0 < 5
    err = one_line(capsys.readouterr().err, "calibrate")
    assert f"--out {out}: cannot create it" in err, err


def test_a_fifo_where_the_lock_file_goes_is_named(tmp_path, capsys, no_model_load):
    """A FIFO at ``.OUT.oscar-lock`` made ``flock`` fail with a bare ``[Errno 22] Invalid argument``."""
    out = tmp_path / "art"
    lock = tmp_path / ".art.oscar-lock"
    os.mkfifo(lock)
    with pytest.raises(FileExistsError, match=f"--out {out}: its lock file {lock} is not a regular file"):
        check_out_dir(out, claim=True)
    t0 = time.perf_counter()
    assert main(["calibrate", "--out", str(out), "--quiet"]) == 2
    assert time.perf_counter() - t0 < 5
    assert f"its lock file {lock} is not a regular file" in one_line(capsys.readouterr().err, "calibrate")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".art.oscar-lock"]
