"""The artifact contract: round trip, identity, and every tampering refused with a message naming it."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from oscar_export.calibration.artifact import OscarArtifact, load_artifact
from oscar_export.calibration.artifact_format import META_FILE, TENSOR_FILE, ArtifactError
from oscar_export.kernels.transform import LayerTransform

from helpers import artifact_config, assert_same_artifact, config_artifact, refused, small_artifact, tamper


@pytest.mark.parametrize("gran,codebook", [("token", False), ("channel", True)])
def test_round_trip_exact(tmp_path, gran, codebook):
    art = config_artifact(key_granularity=gran, codebook=codebook)
    art.save(tmp_path)
    back = load_artifact(tmp_path, artifact_config())
    assert_same_artifact(art, back)
    assert back.layout.key.granularity == gran
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["format_version"] == 1 and meta["num_layers"] == 3
    blob = (tmp_path / TENSOR_FILE).read_bytes()
    assert b"pickle" not in blob and blob[:8] != b"\x80\x04\x95"  # safetensors header, not a pickle


def test_a_save_that_fails_leaves_the_previous_artifact(tmp_path, monkeypatch):
    """Each file is written to a temporary sibling and renamed: a failure before the rename (here the disk refusing
    the fsync of the new tensor file) leaves the old artifact loading as before and no temporary behind."""
    import os

    old = config_artifact()
    old.save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left"):
        config_artifact().save(tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert torch.equal(load_artifact(tmp_path).transforms[0].k_rotation, old.transforms[0].k_rotation)


def test_identity_and_prerotated(tmp_path):
    art = OscarArtifact.identity(artifact_config(), k_clip=0.96, v_clip=0.92)
    assert art.num_layers == 3 and art.layout.num_kv_heads == 2 and art.layout.head_dim == 16
    assert torch.equal(art.transforms[1].k_rotation, torch.eye(16).expand(2, 16, 16))
    assert torch.allclose(art.transforms[0].k_clip, torch.tensor([0.96, 0.96]))
    pre = art.with_values_prerotated()
    pre.save(tmp_path)
    assert all(t.values_prerotated for t in load_artifact(tmp_path).transforms)


def test_bits_per_element():
    art = OscarArtifact.identity(artifact_config(head_dim=64, hidden_size=256))
    # G = P = 64: 16 code bytes + 4 param bytes per 64 elements -> 2.5 bits; windows add BF16 tokens.
    assert art.bits_per_element() == pytest.approx(2.5)
    assert art.bits_per_element(1000) == pytest.approx(art.layout.effective_bits_per_element(1000))


# ---- tampering ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["k_rotation", "v_mean", "k_clip", "v_levels", "k_scale"])
def test_nan_refused(tmp_path, name):
    def poison(t):
        t[f"layers.0.{name}"].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=f"layers.0.{name}: 1 non-finite"):
        load_artifact(tamper(tmp_path, poison))


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


def test_layers_sharing_one_transform_save(tmp_path):
    """Layers may share one LayerTransform object (one set of tensors): safetensors refuses shared storage."""
    art = config_artifact()
    shared = OscarArtifact(art.layout, [art.transforms[0]] * 3, art.fingerprint, art.config, art.stats)
    shared.save(tmp_path)
    assert_same_artifact(shared, load_artifact(tmp_path, artifact_config()))


# ---- the page packing (RowFormat.packing) ----------------------------------------------------------------


def test_packing_round_trip_and_old_artifacts_load_as_linear(tmp_path):
    cfg = artifact_config(head_dim=32, hidden_size=128)
    art = config_artifact(cfg)
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


# ---- per-layer key widths --------------------------------------------------------------------------------------


def test_key_bits_round_trip_and_layer_layouts(tmp_path):
    art = config_artifact().with_key_bits([2, 4, 2])
    assert art.key_bits == (2, 4, 2) and art.mixed_key_bits
    assert art.layout.key.bits == 2  # the base layout stays 2-bit
    assert art.layer_layout(1) == art.layout.with_key_bits(4) and art.layer_layout(0) == art.layout
    art.save(tmp_path / "a")
    assert json.loads((tmp_path / "a" / META_FILE).read_text())["key_bits"] == [2, 4, 2]
    back = load_artifact(tmp_path / "a", artifact_config())
    assert_same_artifact(art, back)
    assert back.key_bits == (2, 4, 2)
    lays = [art.layer_layout(i) for i in range(3)]
    assert art.bits_per_element() == pytest.approx(sum(x.int2_bits_per_element() for x in lays) / 3)
    assert art.bits_per_element() > config_artifact().bits_per_element()


def test_artifacts_without_key_bits_are_all_two_bit(tmp_path):
    art = config_artifact()
    assert art.key_bits == (2, 2, 2) and not art.mixed_key_bits
    art.save(tmp_path / "a")
    assert "key_bits" not in json.loads((tmp_path / "a" / META_FILE).read_text())  # the file is as before
    assert load_artifact(tmp_path / "a").key_bits == (2, 2, 2)


def test_four_bit_keys_fit_fragment_ordered_pages_too(tmp_path):
    """mma16 (fragment-order) pages hold 4-bit keys since the hopper kernel reads them (they were refused before)."""
    cfg = artifact_config(head_dim=32, hidden_size=128)
    art = config_artifact(cfg)
    mma = replace(art.layout, key=replace(art.layout.key, packing="mma16"))
    wide = OscarArtifact(mma, art.transforms, art.fingerprint, key_bits=(4, 2, 2))
    assert wide.key_bits == (4, 2, 2)
    assert mma.with_key_bits(4).key.bits == 4 and mma.with_key_bits(4).key.packing == "mma16"


def test_four_bit_keys_on_a_sliding_layer_refused():
    from helpers import family_config

    cfg = family_config("gemma3_sliding")  # layers 0 and 2 slide
    art = OscarArtifact.identity(cfg)
    art.with_key_bits([2, 4, 2]).check_model(cfg)  # the full-attention layer may be wider
    with pytest.raises(ArtifactError,
                       match=r"key_bits: layers \[2\] are sliding-window layers .* must be 2, got \[4\]"):
        art.with_key_bits([2, 4, 4]).check_model(cfg)


def test_save_dying_half_way_never_leaves_a_loadable_mix(tmp_path, monkeypatch):
    """Each file is replaced whole (temporary + fsync + rename), oscar.json last: a save killed before the last
    rename leaves the old oscar.json beside the new tensors, which its checksum refuses, and no partial file."""
    d = tmp_path / "art"
    small_artifact().save(d)
    real = os.replace

    def killed_before_meta(src, dst):
        if Path(dst).name == META_FILE:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_meta)
    other = small_artifact()
    other = OscarArtifact(other.layout, [LayerTransform.identity(2, 16, 0.5, 0.5)] * 2, other.fingerprint)
    with pytest.raises(KeyboardInterrupt):
        other.save(d)
    monkeypatch.undo()
    assert sorted(p.name for p in d.iterdir()) == [META_FILE, TENSOR_FILE]
    refused(d, "checksum mismatch")


def test_check_model_compares_the_folded_values_of_model_and_artifact():
    """A config with an ``oscar`` section saying ``values_prerotated`` (what export writes) takes only a pre-rotated
    artifact, a plain config only one that is not."""
    from oscar_export.calibration.artifact import values_folded

    cfg = artifact_config()
    art = OscarArtifact.identity(cfg)
    art.check_model(cfg)
    assert values_folded(cfg) is False
    cfg.oscar = {"format_version": 1, "values_prerotated": True}
    assert values_folded(cfg) is True
    with pytest.raises(ValueError, match="values_prerotated: the artifact's value rotation is not folded"):
        art.check_model(cfg)
    art.with_values_prerotated().check_model(cfg)
    del cfg.oscar
    with pytest.raises(ValueError, match="the artifact's value rotation is folded into v_proj / o_proj, this model's "
                                         "is not"):
        art.with_values_prerotated().check_model(cfg)
