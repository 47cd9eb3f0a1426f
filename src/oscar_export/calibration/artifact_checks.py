"""Validation of an artifact's content: its layout, per-layer key widths and every layer's transform.

:func:`validate` is what :class:`~.artifact.OscarArtifact` runs on construction (so an artifact made in memory
is held to the same rules as one read from disk); :func:`parse_layout` and :func:`parse_key_bits` read those
fields from untrusted JSON. Failures are one :class:`~.artifact_format.ArtifactError`.
"""

from __future__ import annotations

from typing import Any

import torch

from oscar_export.kernels.layout import CODE_BITS, UNIFORM_LEVELS, KVCacheLayout, check_packing
from oscar_export.kernels.transform import LayerTransform

from .artifact_format import LAYOUT_KEYS, LIMITS, ORTHO_TOL, ROW_KEYS, ROW_OPTIONAL_KEYS, TENSOR_FIELDS, ArtifactError
from .codebook import MIN_GAP as MIN_LEVEL_GAP
from .fingerprint import FINGERPRINT_KEYS
from .safe_json import describe, json_bool, json_int, json_keys, json_kind, json_object, printable


def check_range(where: str, name: str, x: torch.Tensor) -> None:
    """The range checks of :class:`ArtifactLimits` (the fp16 page params an artifact implies stay finite)."""
    if name.endswith("_mean"):
        m = float(x.abs().max()) if x.numel() else 0.0
        if m > LIMITS.mean_abs_max:
            raise ArtifactError(
                f"{where}.{name}: max |value| {m:.3g} exceeds the limit {LIMITS.mean_abs_max:g} (stored rows are "
                f"x*d - mean; their fp16 page params must stay below {LIMITS.fp16_max:g}; see ArtifactLimits)"
            )
    elif name.endswith("_scale"):
        lo, hi = float(x.min()), float(x.max())
        if lo < LIMITS.scale_min or hi > LIMITS.scale_max:
            got = f"max {hi:.3g}" if hi > LIMITS.scale_max else f"min {lo:.3g}"
            raise ArtifactError(
                f"{where}.{name}: values must lie in [{LIMITS.scale_min:.3g}, {LIMITS.scale_max:g}], got {got} "
                f"(keys are multiplied by d, queries by 1/d; outside this range fp16 page params of ordinary rows "
                f"overflow or underflow (fp16 max {LIMITS.fp16_max:g}); see ArtifactLimits)"
            )


def check_transform(i: int, t: LayerTransform, layout: KVCacheLayout) -> None:
    where = f"layers.{i}"
    if (t.num_kv_heads, t.head_dim) != (layout.num_kv_heads, layout.head_dim):
        raise ArtifactError(
            f"{where}: expected {layout.num_kv_heads} KV heads x head_dim {layout.head_dim}, "
            f"got {t.num_kv_heads} x {t.head_dim}"
        )
    for name in TENSOR_FIELDS:
        x = getattr(t, name)
        if not bool(torch.isfinite(x).all()):
            n = int((~torch.isfinite(x)).sum())
            raise ArtifactError(f"{where}.{name}: {n} non-finite values (NaN/Inf)")
        check_range(where, name, x)
    eye = torch.eye(t.head_dim, dtype=torch.float64)
    for name in ("k_rotation", "v_rotation"):
        r = getattr(t, name).double()
        err = (r.transpose(-1, -2) @ r - eye).abs().amax(dim=(-1, -2))  # [H_kv]
        if bool((err > ORTHO_TOL).any()):
            h = int(err.argmax())
            raise ArtifactError(
                f"{where}.{name}: not orthogonal: max |R^T R - I| = {float(err[h]):.3g} at KV head {h} "
                f"(tolerance {ORTHO_TOL:g}, fp64)"
            )
    for name, fmt in (("k_levels", layout.key), ("v_levels", layout.value)):
        lv = getattr(t, name).double()
        if bool((lv < 0).any() or (lv > 3).any()) or bool((lv[:, 1:] <= lv[:, :-1]).any()):
            raise ArtifactError(f"{where}.{name}: levels must be strictly ascending in [0, 3], got {lv.tolist()}")
        gap = float((lv[:, 1:] - lv[:, :-1]).min())
        if gap < MIN_LEVEL_GAP * (1 - 1e-4):  # fp32 storage of the fitter's gaps
            raise ArtifactError(f"{where}.{name}: levels {lv.tolist()} are {gap:.3g} apart; expected at least "
                                f"{MIN_LEVEL_GAP} (calibration.codebook.MIN_GAP: levels closer than that waste a code)")
        uniform = bool(torch.equal(getattr(t, name), torch.tensor(UNIFORM_LEVELS).expand_as(lv)))
        if not fmt.codebook and not uniform:
            raise ArtifactError(
                f"{where}.{name}: non-uniform levels {lv.tolist()} but the layout's row format has codebook=False"
            )


def validate(art: Any) -> None:
    """Everything ``load_artifact`` checks beyond file integrity, on an ``OscarArtifact`` (its layout, transforms,
    fingerprint and key_bits); raises :class:`ArtifactError`."""
    fp = art.fingerprint
    missing = [k for k in FINGERPRINT_KEYS if k not in fp]
    if missing:
        raise ArtifactError(f"fingerprint: missing keys {missing}")
    if art.num_layers != fp["num_hidden_layers"]:
        raise ArtifactError(
            f"transforms: expected one per layer ({fp['num_hidden_layers']} layers in the fingerprint), "
            f"got {art.num_layers}"
        )
    if (art.layout.num_kv_heads, art.layout.head_dim) != (fp["num_key_value_heads"], fp["head_dim"]):
        raise ArtifactError(
            f"layout: expected {fp['num_key_value_heads']} KV heads x head_dim {fp['head_dim']} (fingerprint), "
            f"got {art.layout.num_kv_heads} x {art.layout.head_dim}"
        )
    for i, t in enumerate(art.transforms):
        check_transform(i, t, art.layout)
    parse_key_bits(art.key_bits, art.num_layers, art.layout)


def parse_key_bits(x: Any, num_layers: int, layout: KVCacheLayout, where: str = "key_bits") -> tuple[int, ...]:
    """Per-layer key code widths from untrusted JSON: a list of ``num_layers`` ints, each in ``CODE_BITS``,
    every wider one a row format ``layout`` can take (``layout.with_key_bits``)."""
    if not isinstance(x, (list, tuple)) or len(x) != num_layers:
        got = f"{len(x)} entries" if isinstance(x, (list, tuple)) else json_kind(x)
        raise ArtifactError(f"{where}: expected a list of {num_layers} code widths (one per layer, each in "
                            f"{list(CODE_BITS)}), got {got}")
    for i, b in enumerate(x):
        if type(b) is not int or b not in CODE_BITS:
            raise ArtifactError(f"{where}[{i}]: expected one of {list(CODE_BITS)}, got {describe(b)}")
    for b in sorted(set(x) - {layout.key.bits}):
        try:
            layout.with_key_bits(b)
        except (ValueError, NotImplementedError) as e:
            raise ArtifactError(f"{where}: {b}-bit keys do not fit the layout's key format ({printable(e)})") from None
    return tuple(x)


def parse_layout(x: Any, where: str = "layout") -> KVCacheLayout:
    """A :class:`KVCacheLayout` from untrusted JSON: exact keys, JSON types and :data:`LIMITS` checked first."""
    L = LIMITS
    d = json_object(x, where)
    json_keys(d, where, LAYOUT_KEYS, LAYOUT_KEYS)
    for side in ("key", "value"):
        r = json_object(d[side], f"{where}.{side}")
        json_keys(r, f"{where}.{side}", ROW_KEYS, ROW_KEYS + ROW_OPTIONAL_KEYS)
        if "packing" in r:
            try:
                check_packing(r["packing"], f"{where}.{side}.packing")
            except ValueError as e:
                raise ArtifactError(printable(e)) from None
        json_int(r["head_dim"], f"{where}.{side}.head_dim", L.min_head_dim, L.max_head_dim)
        json_int(r["group_size"], f"{where}.{side}.group_size", 4, L.max_head_dim)
        if not isinstance(r["granularity"], str) or r["granularity"] not in ("token", "channel"):
            raise ArtifactError(f"{where}.{side}.granularity: expected one of ['token', 'channel'], "
                                f"got {describe(r['granularity'])}")
        json_int(r["bits"], f"{where}.{side}.bits", 2, 2)
        json_bool(r["codebook"], f"{where}.{side}.codebook")
    json_int(d["num_kv_heads"], f"{where}.num_kv_heads", 1, L.max_kv_heads)
    json_int(d["head_dim"], f"{where}.head_dim", L.min_head_dim, L.max_head_dim)
    json_int(d["sink"], f"{where}.sink", 0, L.max_sink)
    json_int(d["window"], f"{where}.window", 0, L.max_window)
    json_int(d["page_size"], f"{where}.page_size", L.min_page_size, L.max_page_size)
    try:
        return KVCacheLayout.from_dict(d)
    except (TypeError, KeyError, ValueError, NotImplementedError) as e:
        raise ArtifactError(f"{where}: {printable(e)}") from None


__all__ = ["check_range", "check_transform", "parse_key_bits", "parse_layout", "validate"]
