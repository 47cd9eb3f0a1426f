"""Issue 31: nothing of the user's lost, refusals before the work, one line for every OS and environment failure.

Every case is the command of the issue (or its library call) with what must hold: the exit code, the one line,
the source and unrelated files intact, and the time (checks that need no model: well under 5 s).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from oscar_export.atomic_dir import MARKER, OutputBusy, OutputChanged, atomic_dir, check_out_dir  # noqa: E402
from oscar_export.cli import main  # noqa: E402

from helpers import random_artifact, tiny_export, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def no_model_load(monkeypatch):
    import oscar_export.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the checks"))


@pytest.fixture
def model_dir(tmp_path):
    """A model folder of the user's: a checkpoint and an unrelated file."""
    d = tmp_path / "my-model"
    tiny_model().save_pretrained(d)
    (d / "notes.txt").write_text("the user's own notes")
    return d


def one_line(err: str, command: str) -> str:
    assert err.count("\n") == 1 and err.startswith(f"oscar-export {command}: error: "), err
    assert "Traceback" not in err
    return err


# ---- outputs never destroy what the user did not ask to replace -----------------------------------------------


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


def test_force_replaces_an_earlier_output_of_the_same_kind_only(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_dir(out, looks_like="config.json") as tmp:
        (tmp / "config.json").write_text("1")
    assert json.loads((out / MARKER).read_text()) == {"tool": "oscar-export", "kind": "config.json"}
    with pytest.raises(FileExistsError, match="no .oscar-output marker of a deploy.json output"):
        check_out_dir(out, force=True, looks_like="deploy.json")  # a checkpoint is not a deployment
    with atomic_dir(out, force=True, looks_like="config.json") as tmp:
        (tmp / "config.json").write_text("2")
    assert (out / "config.json").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_out_appearing_during_the_run_is_not_replaced(tmp_path):
    """Issue: export without --force while something else creates --out/precious.txt: the file was deleted."""
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
    """Issue: two exports to one --out at once both exited 0, the second replacing the first's output."""
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


# ---- checks that need no model, before the model loads -------------------------------------------------------


@pytest.mark.parametrize("out", ["/sys/x", "/proc/x", "/dev/null/x"])
def test_calibrate_unwritable_out_refused_before_the_model_loads(out, capsys, no_model_load):
    if not Path(out).parent.exists():
        pytest.skip(f"{Path(out).parent} does not exist here")
    t0 = time.perf_counter()
    assert main(["calibrate", "--out", out, "--quiet"]) == 2
    assert time.perf_counter() - t0 < 5
    err = one_line(capsys.readouterr().err, "calibrate")
    assert f"--out {out}: cannot create it" in err, err


def test_eval_unwritable_out_and_a_list_to_merge_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    import oscar_export.eval.driver as driver

    t0 = time.perf_counter()
    assert main(["eval", "--quick", "--out", "/dev/null/x"]) == 2
    assert "--out /dev/null/x: cannot create it" in one_line(capsys.readouterr().err, "eval")
    merge = tmp_path / "old.json"
    merge.write_text("[1, 2]")
    assert main(["eval", "--quick", "--out", str(tmp_path / "o"), "--merge", str(merge)]) == 2
    err = one_line(capsys.readouterr().err, "eval")
    assert "expected the JSON object of an earlier results.json" in err and "got list" in err, err
    merge.write_text("{")
    assert main(["eval", "--quick", "--out", str(tmp_path / "o"), "--merge", str(merge)]) == 2
    assert "not valid JSON" in one_line(capsys.readouterr().err, "eval")
    assert time.perf_counter() - t0 < 5
    assert driver.check_outputs is not None


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


# ---- one line for every operating-system failure, nothing half-written ------------------------------------------


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


@pytest.mark.slow  # a child process imports torch and transformers: 10-30 s on the 2-core machine
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


# ---- what build serves: the checkpoint's own files, regular ones, no remote code ---------------------------------


@pytest.fixture(scope="module")
def exported_ckpt(tmp_path_factory):
    pytest.importorskip("triton")
    return tiny_export(tmp_path_factory.mktemp("exp") / "ckpt")


@pytest.fixture
def fake_bundle(monkeypatch):
    """The kernel bundle (30 s of compiling) and the project wheel stand in: this is about the checkpoint copy."""
    import oscar_export.build as build_mod
    import oscar_export.kernels.aot.compile as compile_mod

    def bundle(specs, dest, **kw):
        dest.mkdir()
        (dest / "manifest.json").write_text(json.dumps({"kernels": [], "triton_version": "stand-in"}))

    monkeypatch.setattr(compile_mod, "build_bundle", bundle)
    monkeypatch.setattr(build_mod, "project_wheel", lambda dest: None, raising=False)


def _own_copy(src: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(src, dest)
    return dest


def test_build_refuses_a_symlink_loop_before_compiling(exported_ckpt, tmp_path, capsys, monkeypatch):
    """Issue: ``ln -s . ckpt/loop`` made build copy ~40 nested copies of the checkpoint (1.7 GB for 53 MB)."""
    import oscar_export.kernels.aot.compile as compile_mod

    monkeypatch.setattr(compile_mod, "build_bundle", lambda *a, **k: pytest.fail("compiled before the checks"))
    d = _own_copy(exported_ckpt, tmp_path / "ckpt")
    (d / "loop").symlink_to(".")
    t0 = time.perf_counter()
    assert main(["build", "--export", str(d), "--out", str(tmp_path / "deploy"), "--arch", "sm_90"]) == 2
    assert time.perf_counter() - t0 < 5
    err = one_line(capsys.readouterr().err, "build")
    assert "loop: a symbolic link in the checkpoint" in err and "regular files only" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_build_serves_only_the_checkpoint_and_no_remote_code(exported_ckpt, tmp_path, capsys, fake_bundle):
    """Issue: a config.json auto_map with its modeling_*.py stayed live in the served checkpoint, and a stray
    file was copied byte for byte."""
    d = _own_copy(exported_ckpt, tmp_path / "ckpt")
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


def test_the_deploy_readme_limit_comes_from_the_model(exported_ckpt, tmp_path, fake_bundle):
    """Issue: the generated README said --max_seq_len 8192 for a model of max_position_embeddings 4096."""
    from oscar_export.build import build_deployment

    d = _own_copy(exported_ckpt, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (d / "config.json").write_text(json.dumps(cfg))
    readme = (build_deployment(d, tmp_path / "deploy", ["sm_90"]) / "README.md").read_text()
    assert "--max_seq_len 4096" in readme and "8192" not in readme


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


def test_a_chat_template_that_runs_for_minutes_is_stopped(monkeypatch):
    """Issue: a chat template with nested 1e5 x 1e5 loops ran 80 s and took 7.1 GB."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    import oscar_export.generate as gen

    class Tokenizer:  # renders its template as transformers does: jinja2's immutable sandbox
        chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"

        def apply_chat_template(self, messages, **kw):
            return ImmutableSandboxedEnvironment().from_string(self.chat_template).render(messages=messages)

    monkeypatch.setattr(gen, "CHAT_TEMPLATE_SECONDS", 1)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="--chat: the model's chat template ran past 1 s"):
        gen.render_chat(Tokenizer(), "hello")
    assert time.perf_counter() - t0 < 5
    Tokenizer.chat_template = "<user>{{ messages[0]['content'] }}</user>"
    assert gen.render_chat(Tokenizer(), "hello") == "<user>hello</user>"
