"""``oscar_export/cli.py``: --help, --version, unknown input, the package layout (editable and wheel), and
options refused before the model loads, one line for every user, operating-system and library failure (a full
disk, a file-size limit, undecodable arguments, a chat template the sandbox refuses, a safetensors error)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import transformers

from oscar_export import __version__
from oscar_export.atomic_dir import atomic_dir
from oscar_export.cli import COMMANDS, main

from helpers import files, one_line, random_artifact

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
    """A command whose module cannot be imported is an error naming the module, never a command missing from the
    CLI (a broken install must not look like a smaller tool)."""
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
def test_wheel_contains_every_source_module(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w",
         str(tmp_path)],
        check=True,
    )
    (whl,) = tmp_path.glob("oscar_export-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    # every module of the source tree (setuptools finds the packages under src/: a folder without __init__.py
    # would be silently left out), and nothing else at the wheel's top level
    expected = {path.relative_to(ROOT / "src").as_posix() for path in (ROOT / "src").rglob("*.py")
                if "__pycache__" not in path.parts}
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel: {missing}"
    assert {n.split("/")[0] for n in names if not n.startswith("oscar_export-")} == {"oscar_export"}, names
    # `oscar-export bench` from the wheel alone (it ran benchmarks/bench_decode.py of a source checkout,
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
    """Every argument of ``bench`` is checked before anything runs: one line, exit 2."""
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


# ---- refusals before the model loads; one line for every OS and library failure --------------------------------------


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--device", "cuda"], "--device cuda: no CUDA device is available here"),
    (["generate", "--device", "cuda:3"], "--device cuda:3: no CUDA device is available here"),
    (["generate", "--backend", "triton", "--device", "cpu"], "--backend triton: the Triton kernels run on a CUDA GPU"),
    (["generate", "--backend", "tensorrt"], "--backend: expected one of"),
    (["generate", "--prompt", ""], "--prompt: empty"),
    (["calibrate", "--out", "OUT", "--device-map", "cuda:3"], "--device-map cuda:3: no CUDA device"),
    (["calibrate", "--out", "OUT", "--device-map", '{"model": 3}'], "--device-map cuda:3: no CUDA device"),
], ids=["device-cuda", "device-cuda3", "triton-on-cpu", "unknown-backend", "empty-prompt", "device-map",
        "device-map-json"])
def test_options_refused_before_the_model_loads(argv, msg, tmp_path, capsys, no_model_load):
    import torch

    if "cuda" in msg and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    t0 = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - t0 < 5
    assert msg in one_line(capsys.readouterr().err, argv[0])


def test_undecodable_arguments_are_one_line(tmp_path, capsys, no_model_load):
    bad = os.fsdecode(b"caf\xe9")  # what Python makes of Latin-1 bytes in argv: a lone surrogate
    for argv in (["generate", "--prompt", bad], ["calibrate", "--out", str(tmp_path / bad)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not valid UTF-8" in err and "caf\\xe9" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_chat_template_the_sandbox_refuses_is_one_line(monkeypatch, capsys):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    import oscar_export.generate as gen

    def run(args):  # what transformers' apply_chat_template does with a template that escapes
        ImmutableSandboxedEnvironment().from_string("{{ ''.__class__.__mro__[1].__subclasses__() }}").render()

    monkeypatch.setattr(gen, "run", run)
    assert main(["generate", "--chat"]) == 2
    err = one_line(capsys.readouterr().err, "generate")
    assert "the chat template failed (SecurityError)" in err, err


def test_a_safetensors_error_is_one_line(monkeypatch, capsys):
    from safetensors import SafetensorError

    import oscar_export.inspect_artifact as mod

    for text in ("Error while serializing: I/O error: No space left on device (os error 28)",  # safetensors 0.7
                 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })'):
        def run(args, text=text):
            raise SafetensorError(text)

        monkeypatch.setattr(mod, "run", run)
        assert main(["inspect", "x"]) == 2
        err = one_line(capsys.readouterr().err, "inspect")
        assert "No space left on device [Errno 28 ENOSPC] (Error while serializing)" in err, err


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (root with CAP_SYS_ADMIN only); unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_export_onto_a_full_disk_is_one_line_and_leaves_the_old_output(small_tmpfs, tmp_path, capsys, monkeypatch):
    import oscar_export.models as models

    out = small_tmpfs / "ckpt"
    with atomic_dir(out, looks_like="config.json") as tmp:  # an earlier checkpoint, replaced with --force
        (tmp / "config.json").write_text("{}")
    before = files(out)
    big = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=4000, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128))  # ~1.5 MB of embeddings: 256 KiB free
    random_artifact(big).save(tmp_path / "art")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (big, None))
    assert main(["export", "--artifact", str(tmp_path / "art"), "--out", str(out), "--force"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("oscar-export")]  # (and tqdm's bar)
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert files(out) == before and sorted(p.name for p in small_tmpfs.iterdir()) == ["ckpt"]


EXPORT_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import oscar_export.models as models
    from helpers import tiny_model
    models.load_model = lambda *a, **k: (tiny_model(), None)
    from oscar_export.cli import main
    sys.exit(main(["export", "--artifact", sys.argv[2], "--out", sys.argv[3]]))
""")


@pytest.mark.slow  # a child process imports torch and transformers: 10-30 s on a 2-core machine
def test_export_over_the_file_size_limit_is_one_line(tmp_path, art_dir):
    """``ulimit -f``: writes past the limit fail with EFBIG (Python ignores SIGXFSZ); nothing is left behind."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))

    out = tmp_path / "ckpt"
    p = subprocess.run([sys.executable, "-c", EXPORT_CHILD, str(Path(__file__).parents[1]), str(art_dir), str(out)],
                       preexec_fn=limit, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("oscar-export")]
    assert len(lines) == 1 and "File too large" in lines[0] and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["art"]
