"""The artifact contract: round trip, identity, and every tampering refused with a message naming it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from oscar_export.calibration.artifact import OscarArtifact, load_artifact, write_files
from oscar_export.calibration.artifact_format import META_FILE, ORTHO_TOL, TENSOR_FILE, ArtifactError
from oscar_export.calibration.fingerprint import model_fingerprint
from oscar_export.kernels.layout import KVCacheLayout, RowFormat
from oscar_export.kernels.transform import LayerTransform, hadamard


def tiny_config(**kw) -> LlamaConfig:
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                intermediate_size=128, vocab_size=100, head_dim=16)
    base.update(kw)
    return LlamaConfig(**base)


def random_artifact(config=None, key_granularity="token", codebook=False) -> OscarArtifact:
    config = config or tiny_config()
    fp = model_fingerprint(config)
    h, d = fp["num_key_value_heads"], fp["head_dim"]
    layout = KVCacheLayout.default(h, d, key_granularity=key_granularity)
    if codebook:
        layout = replace(layout, key=replace(layout.key, codebook=True))
    ts = []
    for _ in range(fp["num_hidden_layers"]):
        rk = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0].float()
        rv = (hadamard(d).float() @ torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0].float())
        lv = torch.tensor([0.0, 0.9, 2.1, 3.0]) if codebook else torch.tensor([0.0, 1.0, 2.0, 3.0])
        ts.append(LayerTransform(
            k_rotation=rk, v_rotation=rv, k_scale=torch.rand(h, d) + 0.5, v_scale=torch.rand(h, d) + 0.5,
            k_mean=torch.randn(h, d), v_mean=torch.randn(h, d), k_clip=torch.tensor([0.9, 1.0]),
            v_clip=torch.tensor([0.8, 0.95]), k_levels=lv.expand(h, 4).contiguous(),
            v_levels=torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(h, 4).contiguous(),
        ))
    return OscarArtifact(layout, ts, fp, {"method": "test", "seed": 0}, {"layer_error": [0.5, 0.25, 0.125]})


def assert_same(a: OscarArtifact, b: OscarArtifact) -> None:
    assert a.layout == b.layout and a.fingerprint == b.fingerprint and a.config == b.config and a.stats == b.stats
    for i, (ta, tb) in enumerate(zip(a.transforms, b.transforms, strict=True)):
        for name in ta.__dataclass_fields__:
            x, y = getattr(ta, name), getattr(tb, name)
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f"layer {i} {name}"


@pytest.mark.parametrize("gran,codebook", [("token", False), ("channel", True)])
def test_round_trip_exact(tmp_path, gran, codebook):
    art = random_artifact(key_granularity=gran, codebook=codebook)
    art.save(tmp_path)
    back = load_artifact(tmp_path, tiny_config())
    assert_same(art, back)
    assert back.layout.key.granularity == gran
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["format_version"] == 1 and meta["num_layers"] == 3
    blob = (tmp_path / TENSOR_FILE).read_bytes()
    assert b"pickle" not in blob and blob[:8] != b"\x80\x04\x95"  # safetensors header, not a pickle


def test_a_save_that_fails_leaves_the_previous_artifact(tmp_path, monkeypatch):
    """Each file is written to a temporary sibling and renamed: a failure before the rename (here the disk refusing
    the fsync of the new tensor file) leaves the old artifact loading as before and no temporary behind."""
    import os

    old = random_artifact()
    old.save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left"):
        random_artifact().save(tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert torch.equal(load_artifact(tmp_path).transforms[0].k_rotation, old.transforms[0].k_rotation)


def test_identity_and_prerotated(tmp_path):
    art = OscarArtifact.identity(tiny_config(), k_clip=0.96, v_clip=0.92)
    assert art.num_layers == 3 and art.layout.num_kv_heads == 2 and art.layout.head_dim == 16
    assert torch.equal(art.transforms[1].k_rotation, torch.eye(16).expand(2, 16, 16))
    assert torch.allclose(art.transforms[0].k_clip, torch.tensor([0.96, 0.96]))
    pre = art.with_values_prerotated()
    pre.save(tmp_path)
    assert all(t.values_prerotated for t in load_artifact(tmp_path).transforms)


def test_fingerprint_of_smollm2_like_config():
    fp = model_fingerprint(tiny_config(rope_theta=1e5))
    assert fp["num_hidden_layers"] == 3 and fp["num_key_value_heads"] == 2 and fp["head_dim"] == 16
    assert fp["rope"]["rope_theta"] == 1e5


def test_bits_per_element():
    art = OscarArtifact.identity(tiny_config(head_dim=64, hidden_size=256))
    # G = P = 64: 16 code bytes + 4 param bytes per 64 elements -> 2.5 bits; windows add BF16 tokens.
    assert art.bits_per_element() == pytest.approx(2.5)
    assert art.bits_per_element(1000) == pytest.approx(art.layout.effective_bits_per_element(1000))


# ---- tampering ------------------------------------------------------------------------------------------------


def tamper(tmp_path, edit_tensors=None, edit_meta=None, art=None):
    art = art or random_artifact()
    tensors, meta = art.tensors(), art.metadata("")
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    write_files(tmp_path, meta, tensors)
    return tmp_path


def test_wrong_layer_count_in_files(tmp_path):
    def drop_layer(t):
        for k in [k for k in t if k.startswith("layers.2.")]:
            del t[k]
    with pytest.raises(ValueError, match="tensor names do not match 3 layers: missing \\['layers.2"):
        load_artifact(tamper(tmp_path, drop_layer))


def test_wrong_layer_count_for_model(tmp_path):
    random_artifact().save(tmp_path)
    with pytest.raises(ValueError, match="num_hidden_layers: artifact 3, model 4"):
        load_artifact(tmp_path, tiny_config(num_hidden_layers=4))


def test_renamed_from_another_model(tmp_path):
    """Same shapes, different RoPE and heads: the fingerprint names both."""
    random_artifact(tiny_config(rope_theta=1e4)).save(tmp_path)
    other = tiny_config(rope_theta=1e5)
    with pytest.raises(ValueError, match="rope: artifact"):
        load_artifact(tmp_path, other)
    with pytest.raises(ValueError, match="num_attention_heads: artifact 4, model 2"):
        load_artifact(tmp_path).check_model(tiny_config(num_attention_heads=2, hidden_size=32, rope_theta=1e4))
    load_artifact(tmp_path).check_model(tiny_config(rope_theta=1e4))  # the right model passes


def test_non_orthogonal_refused(tmp_path):
    def skew(t):
        t["layers.1.v_rotation"][1, 0, 3] += 1e-3
    with pytest.raises(ValueError, match="layers.1.v_rotation: not orthogonal.*KV head 1.*tolerance 1e-05"):
        load_artifact(tamper(tmp_path, skew))


def test_fp32_rounding_of_orthogonal_accepted(tmp_path):
    """The tolerance is not so tight that a genuinely orthogonal fp32 matrix fails (D=128)."""
    cfg = tiny_config(head_dim=128, hidden_size=512, num_hidden_layers=1)
    art = random_artifact(cfg)
    r = art.transforms[0].k_rotation.double()
    err = (r.transpose(-1, -2) @ r - torch.eye(128, dtype=torch.float64)).abs().max().item()
    assert err < ORTHO_TOL / 5, err
    art.save(tmp_path)
    load_artifact(tmp_path, cfg)


@pytest.mark.parametrize("name", ["k_rotation", "v_mean", "k_clip", "v_levels", "k_scale"])
def test_nan_refused(tmp_path, name):
    def poison(t):
        t[f"layers.0.{name}"].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=f"layers.0.{name}: 1 non-finite"):
        load_artifact(tamper(tmp_path, poison))


def test_truncated_safetensors_refused(tmp_path):
    random_artifact().save(tmp_path)
    f = tmp_path / TENSOR_FILE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match="checksum mismatch \\(file truncated or modified\\)"):
        load_artifact(tmp_path)
    # Even with a matching checksum (a hand-edited oscar.json), the truncated file is refused by the parser.
    import hashlib
    meta = json.loads((tmp_path / META_FILE).read_text())
    meta["tensor_sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unreadable safetensors file"):
        load_artifact(tmp_path)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: t.__setitem__("layers.0.k_rotation", t["layers.0.k_rotation"][:, :8, :8].contiguous()),
         "k_rotation: expected \\[2, 16, 16\\], got \\(2, 8, 8\\)"),
        (lambda t: t.__setitem__("layers.0.k_clip", torch.tensor([1.2, 0.9])), "k_clip: clip ratios must be in"),
        (lambda t: t.__setitem__("layers.0.v_scale", -t["layers.0.v_scale"]), "v_scale: scalings must be > 0"),
        (lambda t: t.__setitem__("layers.0.v_levels", torch.tensor([[0.0, 2.0, 1.0, 3.0]] * 2)),
         "v_levels: levels must be strictly ascending"),
        (lambda t: t.__setitem__("layers.0.k_levels", torch.tensor([[0.0, 0.5, 2.0, 3.0]] * 2)),
         "non-uniform levels .* codebook=False"),
        (lambda t: t.__setitem__("layers.0.k_mean", t["layers.0.k_mean"].double()), "k_mean: expected float32"),
        (lambda t: t.__setitem__("layers.9.k_mean", torch.zeros(2, 16)), "unexpected \\['layers.9.k_mean'\\]"),
    ],
    ids=["shape", "clip", "scale", "levels-order", "levels-without-codebook", "dtype", "extra-tensor"],
)
def test_bad_tensors_refused(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_artifact(tamper(tmp_path, edit))


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: m.__setitem__("format_version", 99), "unsupported format_version 99"),
        (lambda m: m.__setitem__("format", "something-else"), "expected format 'oscar-kv-artifact'"),
        (lambda m: m["layout"].__setitem__("num_kv_heads", 4),
         "layout has 4 KV heads x head_dim 16, the fingerprint \\(2, 16\\)"),
        (lambda m: m["layout"]["key"].__setitem__("granularity", "row"), "invalid layout"),
        (lambda m: m.pop("fingerprint"), "missing key 'fingerprint'"),
    ],
    ids=["version", "format", "layout-heads", "layout-granularity", "no-fingerprint"],
)
def test_bad_metadata_refused(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_artifact(tamper(tmp_path, edit_meta=edit))


def test_missing_files_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="oscar.json is missing"):
        load_artifact(tmp_path)
    random_artifact().save(tmp_path)
    (tmp_path / TENSOR_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="rotations.safetensors is missing"):
        load_artifact(tmp_path)
    (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_artifact(tmp_path)


def test_constructor_validates():
    art = random_artifact()
    with pytest.raises(ValueError, match="expected one per layer \\(3 layers"):
        OscarArtifact(art.layout, art.transforms[:2], art.fingerprint)
    bad_layout = KVCacheLayout(2, 16, RowFormat(16, 16), RowFormat(16, 16))
    OscarArtifact(bad_layout, art.transforms, art.fingerprint)  # same heads/dim: fine
    with pytest.raises(ValueError, match="layout: expected 2 KV heads x head_dim 16"):
        OscarArtifact(KVCacheLayout.default(3, 16), art.transforms, art.fingerprint)


def test_layers_sharing_one_transform_save(tmp_path):
    """Layers may share one LayerTransform object (one set of tensors): safetensors refuses shared storage."""
    art = random_artifact()
    shared = OscarArtifact(art.layout, [art.transforms[0]] * 3, art.fingerprint, art.config, art.stats)
    shared.save(tmp_path)
    assert_same(shared, load_artifact(tmp_path, tiny_config()))


# ---- the page packing (RowFormat.packing) ----------------------------------------------------------------


def test_packing_round_trip_and_old_artifacts_load_as_linear(tmp_path):
    cfg = tiny_config(head_dim=32, hidden_size=128)
    art = random_artifact(cfg)
    mma = replace(art.layout, key=replace(art.layout.key, packing="mma16"),
                  value=replace(art.layout.value, packing="mma16"))
    art = OscarArtifact(mma, art.transforms, art.fingerprint, art.config, art.stats)
    art.save(tmp_path / "a")
    back = load_artifact(tmp_path / "a", cfg)
    assert back.layout.key.packing == back.layout.value.packing == "mma16"
    assert json.loads((tmp_path / "a" / META_FILE).read_text())["layout"]["key"]["packing"] == "mma16"
    # an artifact written before the field existed: no "packing" key -> linear
    old = tamper(tmp_path / "b",
                 edit_meta=lambda m: (m["layout"]["key"].pop("packing"), m["layout"]["value"].pop("packing")))
    assert load_artifact(old).layout.packing == "linear"


def test_unknown_packing_refused(tmp_path):
    with pytest.raises(ValueError, match=r"layout.value.packing: unknown packing 'zigzag'; "
                                         r"this version knows \['linear', 'mma16'\]"):
        load_artifact(tamper(tmp_path, edit_meta=lambda m: m["layout"]["value"].__setitem__("packing", "zigzag")))
    with pytest.raises(ValueError, match="unknown packing 3"):
        load_artifact(tamper(tmp_path / "x", edit_meta=lambda m: m["layout"]["key"].__setitem__("packing", 3)))


# ---- per-layer key widths (issue 17) ---------------------------------------------------------------------------


def test_key_bits_round_trip_and_layer_layouts(tmp_path):
    art = random_artifact().with_key_bits([2, 4, 2])
    assert art.key_bits == (2, 4, 2) and art.mixed_key_bits
    assert art.layout.key.bits == 2  # the base layout stays 2-bit
    assert art.layer_layout(1) == art.layout.with_key_bits(4) and art.layer_layout(0) == art.layout
    art.save(tmp_path / "a")
    assert json.loads((tmp_path / "a" / META_FILE).read_text())["key_bits"] == [2, 4, 2]
    back = load_artifact(tmp_path / "a", tiny_config())
    assert_same(art, back)
    assert back.key_bits == (2, 4, 2)
    lays = [art.layer_layout(i) for i in range(3)]
    assert art.bits_per_element() == pytest.approx(sum(x.int2_bits_per_element() for x in lays) / 3)
    assert art.bits_per_element() > random_artifact().bits_per_element()


def test_artifacts_without_key_bits_are_all_two_bit(tmp_path):
    art = random_artifact()
    assert art.key_bits == (2, 2, 2) and not art.mixed_key_bits
    art.save(tmp_path / "a")
    assert "key_bits" not in json.loads((tmp_path / "a" / META_FILE).read_text())  # the file is as before
    assert load_artifact(tmp_path / "a").key_bits == (2, 2, 2)


@pytest.mark.parametrize("value, match", [
    ([2, 4], r"key_bits: expected a list of 3 code widths .* got 2 entries"),
    ([2, 4, 2, 2], r"key_bits: expected a list of 3 code widths .* got 4 entries"),
    ("2,4,2", r"key_bits: expected a list of 3 code widths .* got a str"),
    (None, r"key_bits: expected a list of 3 code widths .* got null"),
    ([2, 3, 2], r"key_bits\[1\]: expected one of \[2, 4\], got 3"),
    ([2, 4.0, 2], r"key_bits\[1\]: expected one of \[2, 4\], got 4.0"),
    ([2, True, 2], r"key_bits\[1\]: expected one of \[2, 4\], got True"),
    ([2, "4", 2], r"key_bits\[1\]: expected one of \[2, 4\], got '4'"),
    ([8, 2, 2], r"key_bits\[0\]: expected one of \[2, 4\], got 8"),
])
def test_hostile_key_bits_refused(tmp_path, value, match):
    with pytest.raises(ArtifactError, match=match):
        load_artifact(tamper(tmp_path, edit_meta=lambda m: m.__setitem__("key_bits", value)))
    with pytest.raises(ArtifactError, match=match.split(":")[0]):
        random_artifact().with_key_bits(value)  # the constructor runs the same check


def test_four_bit_keys_fit_fragment_ordered_pages_too(tmp_path):
    """mma16 (fragment-order) pages hold 4-bit keys since the hopper kernel reads them (they were refused before)."""
    cfg = tiny_config(head_dim=32, hidden_size=128)
    art = random_artifact(cfg)
    mma = replace(art.layout, key=replace(art.layout.key, packing="mma16"))
    wide = OscarArtifact(mma, art.transforms, art.fingerprint, key_bits=(4, 2, 2))
    assert wide.key_bits == (4, 2, 2)
    assert mma.with_key_bits(4).key.bits == 4 and mma.with_key_bits(4).key.packing == "mma16"


def test_four_bit_keys_on_a_sliding_layer_refused():
    from test_families import tiny_config as family_config

    cfg = family_config("gemma3_sliding")  # layers 0 and 2 slide
    art = OscarArtifact.identity(cfg)
    art.with_key_bits([2, 4, 2]).check_model(cfg)  # the full-attention layer may be wider
    with pytest.raises(ArtifactError,
                       match=r"key_bits: layers \[2\] are sliding-window layers .* must be 2, got \[4\]"):
        art.with_key_bits([2, 4, 4]).check_model(cfg)
