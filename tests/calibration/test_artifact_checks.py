"""``calibration/artifact_checks.py``: the content checks every artifact passes, in memory or from disk (transforms,
tensor ranges, layout packing, per-layer key widths)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from oscar_export.calibration.artifact import OscarArtifact, load_artifact
from oscar_export.calibration.artifact_format import LIMITS, ORTHO_TOL, ArtifactError
from oscar_export.kernels.layout import KVCacheLayout, RowFormat

from helpers import artifact_config, config_artifact, refused, tamper, written


def test_constructor_validates():
    art = config_artifact()
    with pytest.raises(ValueError, match="expected one per layer \\(3 layers"):
        OscarArtifact(art.layout, art.transforms[:2], art.fingerprint)
    bad_layout = KVCacheLayout(2, 16, RowFormat(16, 16), RowFormat(16, 16))
    OscarArtifact(bad_layout, art.transforms, art.fingerprint)  # same heads/dim: fine
    with pytest.raises(ValueError, match="layout: expected 2 KV heads x head_dim 16"):
        OscarArtifact(KVCacheLayout.default(3, 16), art.transforms, art.fingerprint)


def test_non_orthogonal_refused(tmp_path):
    def skew(t):
        t["layers.1.v_rotation"][1, 0, 3] += 1e-3
    with pytest.raises(ValueError, match="layers.1.v_rotation: not orthogonal.*KV head 1.*tolerance 1e-05"):
        load_artifact(tamper(tmp_path, skew))


def test_fp32_rounding_of_orthogonal_accepted(tmp_path):
    """The tolerance is not so tight that a genuinely orthogonal fp32 matrix fails (D=128)."""
    cfg = artifact_config(head_dim=128, hidden_size=512, num_hidden_layers=1)
    art = config_artifact(cfg)
    r = art.transforms[0].k_rotation.double()
    err = (r.transpose(-1, -2) @ r - torch.eye(128, dtype=torch.float64)).abs().max().item()
    assert err < ORTHO_TOL / 5, err
    art.save(tmp_path)
    load_artifact(tmp_path, cfg)


def test_unknown_packing_refused(tmp_path):
    with pytest.raises(ValueError, match=r"layout.value.packing: unknown packing 'zigzag'; "
                                         r"this version knows \['linear', 'mma16'\]"):
        load_artifact(tamper(tmp_path, edit_meta=lambda m: m["layout"]["value"].__setitem__("packing", "zigzag")))
    with pytest.raises(ValueError, match="unknown packing 3"):
        load_artifact(tamper(tmp_path / "x", edit_meta=lambda m: m["layout"]["key"].__setitem__("packing", 3)))


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
        config_artifact().with_key_bits(value)  # the constructor runs the same check


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("v_mean", 1e6, "layers.1.v_mean: max \\|value\\| 1e\\+06 exceeds the limit 16384"),
        ("k_mean", -3e4, "layers.1.k_mean: max \\|value\\| 3e\\+04 exceeds the limit 16384"),
        ("v_scale", 1e30, "layers.1.v_scale: values must lie in \\[0.000244, 4096\\], got max 1e\\+30"),
        ("k_scale", 1e-30, "layers.1.k_scale: values must lie in \\[0.000244, 4096\\], got min 1e-30"),
    ],
)
def test_unusable_tensor_ranges_refused(tmp_path, name, value, match):
    def edit(t):
        t[f"layers.1.{name}"][0, 3] = value
    err = refused(written(tmp_path, edit_tensors=edit), match)
    assert "fp16" in str(err)  # the message says why the limit exists


def test_extreme_but_usable_ranges_load(tmp_path):
    def edit(t):
        t["layers.0.k_scale"][:] = LIMITS.scale_max
        t["layers.0.v_scale"][:] = LIMITS.scale_min
        t["layers.0.v_mean"][:] = -LIMITS.mean_abs_max
    load_artifact(written(tmp_path, edit_tensors=edit))


def test_codebook_levels_must_be_spaced(art_dir):
    """Fitted levels closer than a resolvable step (``[0, 1e-30, 2e-30, 3]``: KL 5.4 if served) are refused."""
    from oscar_export.calibration.artifact import OscarArtifact

    art = load_artifact(art_dir)
    layout = replace(art.layout, key=replace(art.layout.key, codebook=True))
    bad = torch.tensor([0.0, 1e-30, 2e-30, 3.0]).expand_as(art.transforms[0].k_levels).clone()
    ok = torch.tensor([0.0, 0.9, 2.1, 3.0]).expand_as(bad).clone()
    good = OscarArtifact(layout, tuple(replace(t, k_levels=ok) for t in art.transforms), art.fingerprint, {}, {})
    good.save(art_dir.parent / "good")
    load_artifact(art_dir.parent / "good")
    with pytest.raises(ArtifactError, match=r"k_levels: levels .* are 1e-30 apart; expected at least 0.05"):
        OscarArtifact(layout, tuple(replace(t, k_levels=bad) for t in art.transforms), art.fingerprint, {}, {})
