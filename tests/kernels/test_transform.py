"""The per-layer transform (kernels/transform.py): the stored basis keeps the scores up to a per-query constant and
gives the values back exactly, values already rotated by the exported model are only shifted, the transform's
checks, ``clip_rank`` and ``hadamard``."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from oscar_export.kernels.transform import LayerTransform, clip_rank, hadamard


def _transform(h: int = 2, d: int = 16, seed: int = 0) -> LayerTransform:
    g = torch.Generator().manual_seed(seed)
    rot = lambda: torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64, generator=g))[0].float()  # noqa: E731
    pos = lambda: 0.5 + torch.rand(h, d, generator=g)  # noqa: E731
    return replace(LayerTransform.identity(h, d), k_rotation=rot(), v_rotation=rot(), k_scale=pos(), v_scale=pos(),
                   k_mean=torch.randn(h, d, generator=g), v_mean=torch.randn(h, d, generator=g))


def test_scores_shift_by_one_constant_per_query_and_values_come_back():
    tr = _transform()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 3, 16, generator=g)  # [B, H, T, D]
    k, v = torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)  # [B, H_kv, T, D]
    q_s, k_s = tr.transform_queries(q), tr.transform_keys(k)
    for h in range(6):  # 3 query heads a KV head
        shift = q_s[0, h] @ k_s[0, h // 3].T - q[0, h] @ k[0, h // 3].T  # [T_q, T_k]
        assert (shift - shift[:, :1]).abs().max() < 1e-4, "the same shift for every key of a query"
        assert shift.abs().max() > 1e-2, "the means move the scores (the test sees the basis)"
    o = tr.transform_values(v).repeat_interleave(3, dim=1)  # an attention output that picks one value a position
    assert torch.allclose(tr.restore_output(o), v.repeat_interleave(3, dim=1), atol=1e-5)


def test_prerotated_values_are_only_shifted_by_the_mean():
    tr = replace(_transform(), values_prerotated=True)
    v = torch.randn(1, 2, 4, 16)
    assert torch.equal(tr.transform_values(v), v - tr.v_mean[None, :, None, :])
    assert torch.allclose(tr.restore_output(tr.transform_values(v)), v, atol=1e-6)


def test_identity_and_bad_fields():
    ident = LayerTransform.identity(3, 8, k_clip=0.9)
    x = torch.randn(1, 3, 2, 8)
    assert torch.equal(ident.transform_keys(x), x) and (ident.num_kv_heads, ident.head_dim) == (3, 8)
    assert ident.k_clip.tolist() == pytest.approx([0.9] * 3) and ident.k_levels[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"k_scale: expected \[3, 8\], got \(3, 7\)"):
        replace(ident, k_scale=torch.ones(3, 7))
    with pytest.raises(ValueError, match="v_mean: expected float32, got torch.float64"):
        replace(ident, v_mean=torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"v_clip: clip ratios must be in \(0, 1\]"):
        replace(ident, v_clip=torch.tensor([1.0, 0.0, 0.5]))
    with pytest.raises(ValueError, match="k_scale: scalings must be > 0"):
        replace(ident, k_scale=-torch.ones(3, 8))


def test_clip_rank():
    """``ceil(ratio * group) - 1`` clamped to the group: ratio 1 keeps the max, 0 keeps index 0."""
    ratios = torch.tensor([1.0, 0.95, 1 / 64, 0.0, 63 / 64, 0.5, 0.51])
    assert clip_rank(ratios, 64).tolist() == [63, 60, 0, 0, 62, 31, 32]
    assert clip_rank(torch.tensor([0.5]), 128).tolist() == [63]


def test_hadamard_is_orthogonal_with_entries_of_one_magnitude():
    for n in (1, 2, 16, 128):
        h = hadamard(n)
        assert h.dtype == torch.float64 and torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
        assert torch.equal(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64))
    for n in (0, 12, 96):
        with pytest.raises(NotImplementedError, match=f"power of two, got {n}"):
            hadamard(n)
