"""The value queries' blocks: ``Σ_blocks p^T p`` equals ``P^T P`` of the full probabilities."""

import pytest
import torch

from oscar_export.calibration.covariance import causal_probs
from oscar_export.calibration.objective import value_queries


def naive_value_weights(q, k, scaling, lo, tv, window):
    """``M`` from the ``[T, T]`` probabilities of every head at once, fp64, over query positions ``lo .. T-1`` (the
    definition)."""
    n, h, t, _ = q.shape
    hkv = k.shape[1]
    pos = torch.arange(lo, t)
    p = causal_probs(q, k, scaling)[..., pos, lo : lo + tv].double()  # [N, H_kv, g, Q, T_v]
    if window > 0:
        p = p * (pos[:, None] - torch.arange(lo, lo + tv)[None, :] > window)
    p = p.reshape(n, hkv, -1, tv)
    return p.transpose(-1, -2) @ p / p.shape[2]


@pytest.mark.parametrize("t,lo,tv,window,block", [(96, 16, 64, 32, 16), (97, 16, 48, 0, 32), (130, 8, 112, 5, 24),
                                                  (64, 0, 64, 0, 64), (80, 16, 16, 40, 7), (200, 64, 64, 64, 16)])
def test_value_queries_give_the_full_product(t, lo, tv, window, block):
    torch.manual_seed(t + window)
    q, k = torch.randn(2, 6, t, 16) * 2, torch.randn(2, 2, t, 16) * 2
    blocks, count = value_queries(q, k, 0.25, lo, tv, window, block=block)
    got = torch.zeros(2, 2, tv, tv, dtype=torch.float64)
    for i, seq in enumerate(blocks):
        for pb in seq:
            c = pb.shape[-1]
            got[i, :, :c, :c] += (pb.transpose(-1, -2) @ pb).double()
    want = naive_value_weights(q, k, 0.25, lo, tv, window)
    assert count == 3 * (t - lo)
    err = (got / count - want).abs().max()
    assert err <= 1e-6 * want.abs().max(), f"worst |M - M_ref| {err:.3g} of max {want.abs().max():.3g}"
