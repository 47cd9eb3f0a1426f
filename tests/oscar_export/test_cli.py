"""The command line: --help, --version, unknown input, and the package layout (editable and wheel)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from oscar_export import __version__
from oscar_export.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"oscar-export {__version__}"


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out, f"{name} missing from --help:\n{out}"


def test_a_missing_command_module_is_an_error_not_a_missing_command(monkeypatch):
    """Bug (issue 30): a command whose module could not be imported vanished from the CLI ("command not built
    yet"), so a broken install looked like a smaller tool."""
    import oscar_export.cli as cli

    monkeypatch.setitem(cli.COMMANDS, "ghost", "oscar_export.no_such_command_module")
    with pytest.raises(ModuleNotFoundError, match="no_such_command_module"):
        cli.build_parser()


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 1
    assert "usage: oscar-export" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


def test_import_root_only():
    """The folders kernels/, calibration/, plugins/ are installed only under oscar_export."""
    import oscar_export.calibration  # noqa: F401  (imported for what importing does)
    import oscar_export.kernels  # noqa: F401
    import oscar_export.plugins  # noqa: F401

    for name in ("kernels", "calibration", "plugins"):
        mod = sys.modules.get(name)
        assert mod is None or "oscar_export" not in str(getattr(mod, "__file__", "")), name


@pytest.mark.slow
@pytest.mark.representative
def test_wheel_contains_the_mapped_subpackages(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w",
         str(tmp_path)],
        check=True,
    )
    (whl,) = tmp_path.glob("oscar_export-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    # every module of every mapped folder (a subpackage missing from pyproject's list is silently left out)
    mapped = {"oscar_export": "oscar_export", "kernels": "oscar_export/kernels",
              "calibration": "oscar_export/calibration",
              "plugins": "oscar_export/plugins"}
    expected = {f"{prefix}/{path.relative_to(ROOT / folder).as_posix()}"
                for folder, prefix in mapped.items() for path in (ROOT / folder).rglob("*.py")
                if "__pycache__" not in path.parts}
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel: {missing}"
    assert not any(n.startswith(("kernels/", "calibration/", "plugins/")) for n in names)
    # `oscar-export bench` from the wheel alone (issue 30: it ran benchmarks/bench_decode.py of a source checkout,
    # FileNotFoundError from a wheel): on a CPU it gets as far as the GPU check
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import oscar_export.bench as b; "
             "assert b.__file__.startswith(sys.argv[1]), b.__file__; from oscar_export.cli import main; "
             "sys.exit(main(['bench', '--shapes', '1x256']))")
    proc = subprocess.run([sys.executable, "-c", probe, str(site)], capture_output=True, text=True, cwd=tmp_path)
    import torch

    if not torch.cuda.is_available():
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]


def test_bench_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--shapes", "1x"], "--shapes: expected BATCHxLENGTH"),
    (["--shapes", "0x8192"], "got '0x8192'"),
    (["--shapes", "4096x1000000"], "batch x length in [1, 16777216]"),
    (["--keys", "token,row"], "--keys: expected a comma list of ['token', 'channel'], got 'row'"),
    (["--key-bits", "3"], "--key-bits: expected a comma list of [2, 4], got '3'"),
])
def test_bench_refuses_bad_arguments_before_anything_runs(capsys, argv, msg):
    """Bug (issue 30): the help's example (``--variants v3,v4``) raised a KeyError traceback; now every argument
    is checked first, one line, exit 2."""
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1, err


# ---- every error a user can cause: one line, exit 2; --debug shows the traceback ---------------------------


@pytest.mark.parametrize(
    "exc,msg",
    [
        (OSError(28, "No space left on device"), "No space left on device"),
        (PermissionError(13, "Permission denied", "/root/x"), "Permission denied: '/root/x'"),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate 16 GB"),
         "can't allocate 16 GB"),
        (MemoryError(), "out of memory (MemoryError)"),
        (KeyboardInterrupt(), "interrupted"),
        (RecursionError("maximum recursion depth exceeded"), "maximum recursion depth exceeded"),
        (ValueError("line one\nline two"), "line one line two"),
    ],
    ids=["oserror", "permission", "alloc", "memory", "interrupt", "recursion", "multiline"],
)
def test_user_errors_are_one_line(monkeypatch, capsys, exc, msg):
    import oscar_export.inspect_artifact as mod

    def fail(args):
        raise exc

    monkeypatch.setattr(mod, "run", fail)
    assert main(["inspect", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oscar-export inspect: error: ") and msg in err, err
    assert "Traceback" not in err


def test_debug_shows_the_traceback(monkeypatch):
    import oscar_export.inspect_artifact as mod

    monkeypatch.setattr(mod, "run", lambda args: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(MemoryError):
        main(["--debug", "inspect", "x"])


def test_a_bug_is_not_hidden(monkeypatch):
    """TypeError/AttributeError mean a bug in this program, not a user mistake: they keep their traceback."""
    import oscar_export.inspect_artifact as mod

    monkeypatch.setattr(mod, "run", lambda args: None.missing)
    with pytest.raises(AttributeError):
        main(["inspect", "x"])
