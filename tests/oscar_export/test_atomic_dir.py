"""``oscar_export/atomic_dir.py``: the transactional output directory: all or nothing, signals, stale temporaries,
--force, and --force replacing only an earlier output of the same kind, an --out that appears or changes
during the run kept, concurrent runs leaving exactly one complete output. What --out may be: ``test_out_dir.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from oscar_export.atomic_dir import OutputChanged, atomic_dir, is_temporary
from oscar_export.out_dir import MARKER, check_out_dir

from helpers import files, random_artifact, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_success_renames_into_place(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and is_temporary(tmp) and not out.exists()
        (tmp / "a.txt").write_text("a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("b")
    assert (out / "a.txt").read_text() == "a" and (out / "sub" / "b.txt").read_text() == "b"
    assert siblings(out) == ["out"]


def test_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(out) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    assert siblings(out) == []


def test_files_and_directories_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "f").write_text("x")
    names = [Path(p).name for p in synced]
    assert "f" in names and "sub" in names, synced
    assert synced[-1] == str(tmp_path), "the parent directory is fsynced after the rename"


def test_non_empty_out_refused_unless_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with atomic_dir(out, looks_like="oscar.json") as tmp:  # an empty directory is fine
        (tmp / "oscar.json").write_text("1")
    with pytest.raises(FileExistsError, match=f"--out {out}: already exists and is not empty.*--force"):
        check_out_dir(out, force=False, looks_like="oscar.json")
    with pytest.raises(FileExistsError, match="not empty"):
        with atomic_dir(out):
            pytest.fail("entered")
    with atomic_dir(out, force=True, looks_like="oscar.json") as tmp:
        (tmp / "oscar.json").write_text("2")
    assert (out / "oscar.json").read_text() == "2" and siblings(out) == ["out"]


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from oscar_export.atomic_dir import atomic_dir
    with atomic_dir(Path(sys.argv[1])) as tmp:
        (tmp / "partial").write_text("x")
        print(tmp, flush=True)
        time.sleep(60)
""")


def start_child(out: Path) -> tuple[subprocess.Popen, Path]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    tmp = Path(p.stdout.readline().strip())
    assert tmp.is_dir(), tmp
    return p, tmp


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up(tmp_path, sig):
    out = tmp_path / "out"
    p, tmp = start_child(out)
    p.send_signal(sig)
    rc = p.wait(timeout=20)
    assert rc != 0 and not tmp.exists() and not out.exists(), (rc, siblings(out))


def test_stale_temporary_of_a_killed_run_is_removed(tmp_path):
    out = tmp_path / "out"
    p, tmp = start_child(out)
    live = start_child(tmp_path / "other")  # a run still in progress for another output
    try:
        p.kill()  # SIGKILL: nothing can clean up
        p.wait(timeout=20)
        assert tmp.exists()
        with atomic_dir(out) as new:
            assert not tmp.exists(), "the killed run's temporary is removed on the next run"
            (new / "done").write_text("1")
        assert siblings(out) == sorted(["out", live[1].name, ".other.oscar-lock"])  # the live run's lock
        with atomic_dir(tmp_path / "other2"):
            pass
        assert live[1].exists(), "a live process's temporary is never removed"
    finally:
        live[0].kill()
        live[0].wait(timeout=20)


def test_foreign_directories_are_not_temporaries(tmp_path):
    """Only names of the exact pattern (pid, process start time, token) are ever candidates for removal."""
    foreign = [".out.tmp-123", ".out.oscar-tmp-x", "out.oscar-tmp-999999999-1-abcd0123",
               ".out.oscar-tmp-999999999-abcd0123", ".out.oscar-tmp-999999999-1-abcd0123-suffix"]
    other = ".other.oscar-tmp-999999999-1-abcd0123"  # a dead run's temporary, but for another output
    link = ".out.oscar-tmp-999999999-1-abcd0123"  # the right name, but a symlink: not a directory of ours
    for name in (*foreign, other):
        (tmp_path / name).mkdir()
    (tmp_path / link).symlink_to(tmp_path / ".out.tmp-123")
    assert not any(is_temporary(tmp_path / n) for n in foreign)
    assert is_temporary(tmp_path / other) and is_temporary(tmp_path / link)
    with atomic_dir(tmp_path / "out"):
        pass
    assert siblings(tmp_path / "out") == sorted(["out", link, other, *foreign])


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_interrupted_replace_is_recovered(tmp_path, exchange):
    """A run killed during a replace: ``out`` is always a complete output (the new one right after the swap; with
    two plain renames, the old one is put back by the next run)."""
    out = tmp_path / "out"
    with atomic_dir(out, looks_like="oscar.json") as tmp:
        (tmp / "oscar.json").write_text("old")
    child = textwrap.dedent("""
        import os, sys
        from pathlib import Path
        import oscar_export.atomic_dir as ad
        if sys.argv[2] == "0":
            ad._renameat2 = None
        real = os.rename
        def rename(a, b):
            real(a, b)
            if Path(b).name.startswith(".out.oscar-old-"):
                os.kill(os.getpid(), 9)
        ad.os.rename = rename
        with ad.atomic_dir(Path(sys.argv[1]), force=True, looks_like="oscar.json") as tmp:
            (tmp / "oscar.json").write_text("new")
    """)
    p = subprocess.run([sys.executable, "-c", child, str(out), str(int(exchange))], cwd=ROOT, timeout=60)
    assert p.returncode == -9
    assert (out / "oscar.json").read_text() == "new" if exchange else not out.exists()
    time.sleep(0.05)
    with pytest.raises(FileExistsError):  # the next run first tidies up (puts the old output back), then refuses
        with atomic_dir(out):
            pass
    assert (out / "oscar.json").read_text() == ("new" if exchange else "old") and siblings(out) == ["out"]


# ---- through the commands: outputs never destroy what the user did not ask to replace --------------------------------


def test_force_replaces_an_earlier_output_of_the_same_kind_only(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_dir(out, looks_like="config.json") as tmp:
        (tmp / "config.json").write_text("1")
    assert json.loads((out / MARKER).read_text()) == {"tool": "oscar-export", "kind": "config.json",
                                                      "files": ["config.json"]}
    with pytest.raises(FileExistsError, match="no .oscar-output marker of a deploy.json output"):
        check_out_dir(out, force=True, looks_like="deploy.json")  # a checkpoint is not a deployment
    with atomic_dir(out, force=True, looks_like="config.json") as tmp:
        (tmp / "config.json").write_text("2")
    assert (out / "config.json").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_out_appearing_during_the_run_is_not_replaced(tmp_path):
    """An --out that something else creates while export runs without --force (``--out/precious.txt``) is kept."""
    out = tmp_path / "out"
    with pytest.raises(OutputChanged, match=r"--out .*out: appeared while this run worked; it was not replaced, "
                                            r"the new output is kept in .*out\.oscar-new-"):
        with atomic_dir(out, looks_like="config.json") as tmp:
            (tmp / "config.json").write_text("new")
            out.mkdir()
            (out / "precious.txt").write_text("mine")
    assert files(out) == {"precious.txt": b"mine"}
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("out.oscar-new-")]
    assert (kept / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", kept.name])


def test_export_out_appearing_during_the_run_keeps_the_users_file(tmp_path, capsys):
    class Tokenizer:  # writes its files while, elsewhere, the user's program creates --out
        def save_pretrained(self, d):
            out.mkdir()
            (out / "precious.txt").write_text("mine")

    from oscar_export.export import export_checkpoint

    out = tmp_path / "ckpt"
    model = tiny_model()
    with pytest.raises(OutputChanged, match="appeared while this run worked"):
        export_checkpoint(model, Tokenizer(), random_artifact(model), out)
    assert files(out) == {"precious.txt": b"mine"}


def test_force_out_changed_during_the_run_is_not_replaced(tmp_path):
    out = tmp_path / "art"
    with atomic_dir(out, looks_like="oscar.json") as tmp:
        (tmp / "oscar.json").write_text("old")
    with pytest.raises(OutputChanged, match="changed while this run worked"):
        with atomic_dir(out, force=True, looks_like="oscar.json") as tmp:
            (tmp / "oscar.json").write_text("new")
            time.sleep(0.01)  # a coarse-timestamp filesystem still sees the directory change
            (out / "added-meanwhile.txt").write_text("mine")
    assert (out / "added-meanwhile.txt").read_text() == "mine" and (out / "oscar.json").read_text() == "old"


RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from oscar_export.atomic_dir import atomic_dir
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.001)
    try:
        with atomic_dir(Path(sys.argv[1]), looks_like="config.json") as tmp:
            (tmp / "config.json").write_text(sys.argv[3])
            time.sleep(0.2)
    except OSError as e:
        print(type(e).__name__, e)
        sys.exit(2)
""")


def test_concurrent_runs_leave_exactly_one_complete_output(tmp_path):
    out, go = tmp_path / "ckpt", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(out), str(go), str(i)], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT) for i in range(3)]
    time.sleep(1.0)  # let them all import and wait at the barrier
    go.touch()
    results = [(p.wait(timeout=60), p.stdout.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2, 2], results
    winner = [i for i, (rc, _) in enumerate(results) if rc == 0][0]
    assert (out / "config.json").read_text() == str(winner)
    assert all("OutputBusy" in msg or "FileExistsError" in msg for rc, msg in results if rc), results
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt", "go"]




def test_force_keeps_what_the_tool_did_not_write(tmp_path, capsys):
    """The marker lists what the tool wrote: a stale file of its own goes, the user's entries (a file, a folder, a
    link) are kept in the new output; an earlier output whose marker has no list keeps what the new one lacks."""
    out = tmp_path / "ckpt"
    with atomic_dir(out, looks_like="config.json") as tmp:
        (tmp / "config.json").write_text("1")
        (tmp / "model-00001-of-00002.safetensors").write_text("old shard")
    assert json.loads((out / MARKER).read_text())["files"] == ["config.json", "model-00001-of-00002.safetensors"]
    (out / "NOTES.txt").write_text("mine")
    (out / "plots").mkdir()
    (out / "plots" / "a.png").write_text("png")
    (out / "latest").symlink_to("NOTES.txt")
    with atomic_dir(out, force=True, looks_like="config.json") as tmp:
        (tmp / "config.json").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "NOTES.txt", "config.json", "latest", "plots"]
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "plots" / "a.png").read_text() == "png"
    assert os.readlink(out / "latest") == "NOTES.txt" and (out / "config.json").read_text() == "2"
    assert "kept what oscar-export did not write there: NOTES.txt, latest, plots" in capsys.readouterr().err
    (out / MARKER).write_text(json.dumps({"tool": "oscar-export", "kind": "config.json"}))  # an older marker
    with atomic_dir(out, force=True, looks_like="config.json") as tmp:
        (tmp / "config.json").write_text("3")
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "config.json").read_text() == "3"
    assert siblings(out) == ["ckpt"]


def test_force_refuses_a_users_file_the_new_output_also_has(tmp_path):
    out = tmp_path / "art"
    with atomic_dir(out, looks_like="oscar.json") as tmp:
        (tmp / "oscar.json").write_text("1")
    (out / "stats.json").write_text("mine")
    with pytest.raises(FileExistsError, match="stats.json there was not written by oscar-export and the new output"):
        with atomic_dir(out, force=True, looks_like="oscar.json") as tmp:
            (tmp / "oscar.json").write_text("2")
            (tmp / "stats.json").write_text("tool's")
    assert (out / "stats.json").read_text() == "mine" and (out / "oscar.json").read_text() == "1"
    assert siblings(out) == ["art"]
