"""`oscar-export build`: the deployable directory from an exported checkpoint, and its error cases."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")


from oscar_export.build import build_deployment  # noqa: E402
from oscar_export.calibration.artifact import OscarArtifact  # noqa: E402
from oscar_export.cli import main  # noqa: E402
from oscar_export.export import export_checkpoint  # noqa: E402
from oscar_export.kernels.aot.manifest import read_manifest  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout  # noqa: E402
from oscar_export.out_dir import MARKER  # noqa: E402

from helpers import own_copy, tiny_export  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("exp") / "ckpt")


@pytest.mark.slow  # ~30 s on 2 CPUs: compiles the whole serving bundle (one target)
def test_build_writes_the_deployment(exported, tmp_path):
    out = build_deployment(exported, tmp_path / "deploy", ["sm_90"], onnx=True)
    assert sorted(p.name for p in out.iterdir()) == [
        MARKER, "README.md", "checkpoint", "deploy.json", "extra_llm_api_options.yaml", "kernels", "onnx",
        "trtllm_module", "wheels"]  # MARKER: every output of the tool says so (atomic_dir, since 039c976)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deploy"]  # no temp dir left
    m = read_manifest(out / "kernels")
    assert m.archs() == ["sm_90"]
    names = {e.name for e in m.entries}
    assert any(n.startswith("decode_split_") for n in names) and any(n.startswith("quant_pack_v_") for n in names)
    readme = (out / "README.md").read_text()
    assert "trtllm-serve serve ./checkpoint --backend pytorch --custom_module_dirs ./trtllm_module" in readme
    assert "Untested here" in readme
    deploy = json.loads((out / "deploy.json").read_text())
    assert deploy["executed_here"]["tensorrt_llm"] is False and deploy["model"]["num_heads"] == 2
    assert (out / "trtllm_module" / "__init__.py").read_text().count("register(") == 1
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["oscar_decode_attention.onnx",
                                                               "oscar_decode_attention_trt.onnx"]
    assert transformers.AutoConfig.from_pretrained(out / "checkpoint").oscar["values_prerotated"] is True


def test_unknown_arch_leaves_nothing(exported, tmp_path):
    with pytest.raises(ValueError, match="unknown GPU arch 'sm_75'"):
        build_deployment(exported, tmp_path / "d", ["sm_75"])
    assert not any(tmp_path.iterdir())


def test_not_an_export(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no 'oscar' section"):
        build_deployment(tmp_path / "plain", tmp_path / "d", ["sm_90"])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        build_deployment(tmp_path / "nothing", tmp_path / "d", ["sm_90"])


def test_missing_artifact_and_mismatched_heads(exported, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    shutil.rmtree(broken / "oscar_artifact")
    with pytest.raises(FileNotFoundError, match="artifact oscar_artifact/ is missing"):
        build_deployment(broken, tmp_path / "d", ["sm_90"])
    edited = tmp_path / "edited"
    shutil.copytree(exported, edited)
    cfg = json.loads((edited / "config.json").read_text())
    cfg["num_key_value_heads"] = 2
    (edited / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config has 2 KV heads x head_dim 64, its artifact layout 1 x 64"):
        build_deployment(edited, tmp_path / "d", ["sm_90"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "edited"]


def test_cli_errors(exported, tmp_path, capsys):
    (tmp_path / "something").write_text("x")  # an empty --out is fine; a non-empty one needs --force
    assert main(["build", "--export", str(exported), "--out", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["build", "--export", str(exported), "--out", str(tmp_path / "x"), "--arch", "sm_70"]) == 2
    assert "unknown GPU arch 'sm_70'" in capsys.readouterr().err


# ---- build verifies the artifact it packages ------------------------------------------------------------------


@pytest.fixture
def no_compile(monkeypatch):
    """Compiling the bundle means the checks came too late (and would take ~30 s)."""
    import oscar_export.kernels.aot.compile as compile_mod

    monkeypatch.setattr(compile_mod, "build_bundle", lambda *a, **k: pytest.fail("bundle compiled before the checks"))


def _copy(exported, tmp_path, name="ck"):
    d = tmp_path / name
    shutil.copytree(exported, d)
    return d


def _edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def test_flipped_byte_in_the_artifact_refused(exported, tmp_path, no_compile):
    d = _copy(exported, tmp_path)
    f = d / "oscar_artifact" / "rotations.safetensors"
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 4
    f.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="checksum mismatch"):
        build_deployment(d, tmp_path / "out", ["sm_90"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: c.__setitem__("num_hidden_layers", 2), "config has 2 layers, its artifact 1"),
        (lambda c: c.__setitem__("num_attention_heads", 4) or c.__setitem__("head_dim", 64),
         "config has 4 query heads, its artifact 2"),
        (lambda c: c.__setitem__("head_dim", 32), "config has 1 KV heads x head_dim 32, its artifact layout 1 x 64"),
        (lambda c: c["oscar"]["layout"].__setitem__("window", 8), "the 'oscar' section's layout disagrees"),
        (lambda c: c.__setitem__("num_hidden_layers", "1"), "num_hidden_layers: expected an int"),
        (lambda c: c.__setitem__("num_attention_heads", [2]), "num_attention_heads: expected an int"),
    ],
    ids=["layers", "heads", "head_dim", "section-layout", "layers-str", "heads-list"],
)
def test_layout_against_config_json(exported, tmp_path, no_compile, edit, match):
    d = _copy(exported, tmp_path)
    _edit_config(d, edit)
    with pytest.raises(ValueError, match=match):
        build_deployment(d, tmp_path / "out", ["sm_90"])


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_artifact_outside_the_checkpoint_refused(exported, tmp_path, no_compile, kind):
    d = _copy(exported, tmp_path)
    outside = tmp_path / "outside_art"
    shutil.move(d / "oscar_artifact", outside)
    if kind == "dotdot":
        _edit_config(d, lambda c: c["oscar"].__setitem__("artifact", "../outside_art"))
    elif kind == "absolute":
        _edit_config(d, lambda c: c["oscar"].__setitem__("artifact", str(outside)))
    else:
        (d / "oscar_artifact").symlink_to(outside)
    with pytest.raises(ValueError, match="artifact .* outside the checkpoint"):
        build_deployment(d, tmp_path / "out", ["sm_90"])


def test_cli_non_empty_out_needs_force(exported, tmp_path, capsys, no_compile):
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "x").write_text("x")
    assert main(["build", "--export", str(exported), "--out", str(tmp_path / "deploy")]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["build", "--export", str(exported), "--out", str(tmp_path / "deploy"), "--force"]) == 2
    assert "does not look like" in capsys.readouterr().err  # no deploy.json: not replaced even with --force
    assert (tmp_path / "deploy" / "x").exists()


@pytest.mark.parametrize("where", ["inside", "around"])
def test_out_overlapping_the_checkpoint_refused(exported, tmp_path, no_compile, where):
    """--out inside the checkpoint would copy the temporary into itself; --out around it would delete it."""
    d = _copy(exported, tmp_path / "deploy" if where == "around" else tmp_path)
    out = d / "deploy" if where == "inside" else tmp_path / "deploy"
    if where == "around":
        (out / "deploy.json").write_text("{}")  # an earlier deployment, replaced with --force
    with pytest.raises(ValueError, match="--out .* overlaps the checkpoint"):
        build_deployment(d, out, ["sm_90"], force=True)
    assert (d / "config.json").is_file()


def test_bundle_bakes_the_models_attention_scale(tmp_path, monkeypatch):
    """Gemma 3 scales by query_pre_attn_scalar ** -0.5 (here 256 ** -0.5), not head_dim ** -0.5 (64 ** -0.5): the
    decode kernels of the bundle, deploy.json and the ONNX node carry the model's scale. Compiling is replaced
    by recording the specs (the compile itself is tested above)."""
    import oscar_export.kernels.aot.compile as aot_compile
    import oscar_export.onnx_export as onnx_export

    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                        query_pre_attn_scalar=256, layer_types=["full_attention"])
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    ckpt = export_checkpoint(model, None, OscarArtifact.identity(model), tmp_path / "ckpt")
    seen = {}

    def record_bundle(specs, out, archs, progress=None, packing=None, key_bits=None):
        seen["specs"] = specs
        seen["packing"] = packing
        seen["key_bits"] = key_bits
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"kernels": [], "triton_version": "recorded"}))

    monkeypatch.setattr(aot_compile, "build_bundle", record_bundle)
    monkeypatch.setattr(onnx_export, "export_decode_attention_onnx",
                        lambda layout, heads, sm_scale, out: seen.setdefault("onnx_scale", sm_scale))
    out = build_deployment(ckpt, tmp_path / "deploy", ["sm_90"], onnx=True)
    scales = {dict(s.constexprs)["SM_SCALE"] for s in seen["specs"] if "SM_SCALE" in dict(s.constexprs)}
    assert scales == {256**-0.5} and seen["onnx_scale"] == 256**-0.5
    assert seen["packing"] == {"key": "linear", "value": "linear"}  # the layout's page packing goes to the manifest
    assert seen["key_bits"] == [2]
    assert json.loads((out / "deploy.json").read_text())["model"]["sm_scale"] == 256**-0.5
    # the TensorRT-LLM adapter serves llama only: no module, no options, the checkpoint's architectures kept
    assert json.loads((out / "deploy.json").read_text())["trtllm_module"] is False
    assert not (out / "trtllm_module").exists() and not (out / "extra_llm_api_options.yaml").exists()
    assert not (out / "wheels").exists()
    assert "No `trtllm_module/`" in (out / "README.md").read_text()


@pytest.mark.slow  # ~1 min on 2 CPUs: the whole head_dim-256 bundle through ptxas (one target)
def test_gemma3_head_dim_256_export_builds_a_bundle(tmp_path):
    """A Gemma 3 export with interleaved local layers and head_dim 256 (two groups of 128 per row, token keys):
    ``build`` compiles every serving kernel for sm_90, tagged ``g128``, and the ONNX node."""
    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=32,
                                        layer_types=["sliding_attention", "full_attention"])
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    art = OscarArtifact.identity(model, KVCacheLayout.default(1, 256, "token"))
    ckpt = export_checkpoint(model, None, art, tmp_path / "ckpt")
    out = build_deployment(ckpt, tmp_path / "deploy", ["sm_90"], onnx=True)
    names = {e.name for e in read_manifest(out / "kernels").entries}
    tag = "h2kv1d256g128p128s64w256_ktok"
    for k in ("decode_split", "decode_merge", "quant_pack_k", "quant_pack_k_rot", "quant_pack_v", "decode_append"):
        assert f"{k}_{tag}" in names, f"{k}_{tag} not in {sorted(names)}"
    assert json.loads((out / "deploy.json").read_text())["model"]["head_dim"] == 256


def test_bundle_carries_a_kernel_set_per_key_width_of_the_artifact(tmp_path, monkeypatch):
    """An artifact with 4-bit keys in some layers gets the 2-bit and the 4-bit (``_k4``) kernels, and the
    manifest records both widths (compiling replaced by recording the specs)."""
    import oscar_export.kernels.aot.compile as aot_compile

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    art = OscarArtifact.identity(model).with_key_bits((4, 2))
    ckpt = export_checkpoint(model, None, art, tmp_path / "ckpt")
    seen = {}

    def record_bundle(specs, out, archs, progress=None, packing=None, key_bits=None):
        seen.update(specs=specs, key_bits=key_bits)
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"kernels": [], "triton_version": "recorded"}))

    monkeypatch.setattr(aot_compile, "build_bundle", record_bundle)
    build_deployment(ckpt, tmp_path / "deploy", ["sm_90"])
    assert seen["key_bits"] == [2, 4]
    names = [s.name for s in seen["specs"]]
    assert any(n.endswith("_k4") for n in names) and any(not n.endswith("_k4") for n in names), names


def test_onnx_of_4bit_key_layers_refused_before_compiling(tmp_path, no_compile):
    """The ONNX form and the TensorRT plugins unpack 2-bit codes: ``--onnx`` with 4-bit keys in some layers (what
    ``calibrate`` makes by default) is refused before the bundle compiles, naming the flag that gives an exportable
    artifact; nothing is written."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ckpt = export_checkpoint(model, None, OscarArtifact.identity(model).with_key_bits((4, 2)), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"--onnx: the ONNX form and the TensorRT plugins read 2-bit key pages; this "
                                         r"artifact has 4-bit keys in 1 of 2 layers \[0\] \(calibrate "
                                         r"--key-bits-budget none gives 2-bit keys everywhere\)"):
        build_deployment(ckpt, tmp_path / "deploy", ["sm_90"], onnx=True)
    assert not (tmp_path / "deploy").exists()


def _recording_bundle(monkeypatch):
    import oscar_export.kernels.aot.compile as aot_compile

    seen = {}

    def record_bundle(specs, out, archs, progress=None, packing=None, key_bits=None):
        seen.update(specs=specs, archs=archs, packing=packing)
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"kernels": [], "triton_version": "recorded"}))

    monkeypatch.setattr(aot_compile, "build_bundle", record_bundle)
    return seen


def test_the_bundle_packing_is_the_serving_gpus_not_the_artifacts(tmp_path, monkeypatch):
    """The pages' packing is chosen by the GPU that serves them (``kernels.decode.select_backend``), an
    artifact's packing (``calibrate --packing``, gone) is only read: a model family without the TensorRT-LLM module
    gets the Hopper kernel on mma16 pages in an sm_90-only bundle and the portable kernel on linear pages for several
    archs; the ONNX form and the TensorRT-LLM module (which read linear pages) get linear pages. (Recorded, not
    compiled here: tests/kernels/test_aot_bundle.py compiles both.)"""
    import oscar_export.build as build_mod

    seen = _recording_bundle(monkeypatch)
    ck = tiny_export(tmp_path / "ck", packing="mma16")
    split = lambda: [s.kernel.rsplit(":", 1)[1] for s in seen["specs"] if s.name.startswith("decode_split")]  # noqa
    monkeypatch.setattr(build_mod, "write_trtllm_files", lambda tmp, layout: False)
    monkeypatch.setattr("oscar_export.plugins.trtllm.deployment.SUPPORTED_FAMILIES", ())
    for archs, packing, kernel, name in ((["sm_90"], "mma16", "_decode_split_gl_kernel", "hopper"),
                                         (["sm_80", "sm_90"], "linear", "decode_split_kernel", "portable")):
        out = build_deployment(ck, tmp_path / f"d{len(archs)}", archs)
        assert seen["packing"] == {"key": packing, "value": packing} and split() == [kernel]
        assert json.loads((out / "deploy.json").read_text())["decode_kernel"] == name


def test_build_has_no_decode_kernel_knob(capsys):
    """``build`` has no ``--decode-kernel`` option: the targets choose the kernel (the test above)."""
    with pytest.raises(SystemExit) as e:
        main(["build", "--export", "ck", "--out", "d", "--decode-kernel", "gluon"])
    assert e.value.code == 2 and "unrecognized arguments: --decode-kernel" in capsys.readouterr().err


def test_the_deploy_readme_limit_comes_from_the_model(exported_ckpt, tmp_path, fake_bundle):
    """The generated README proposes a --max_seq_len within the model's max_position_embeddings (4096 here)."""
    from oscar_export.build import build_deployment

    d = own_copy(exported_ckpt, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (d / "config.json").write_text(json.dumps(cfg))
    readme = (build_deployment(d, tmp_path / "deploy", ["sm_90"]) / "README.md").read_text()
    assert "--max_seq_len 4096" in readme and "8192" not in readme
