"""The objective's value weights ``M``: the blocked, tiled product equals ``P^T P`` of the full probabilities."""

import pytest
import torch

from oscar_export.calibration.covariance import causal_probs
from oscar_export.calibration.objective import value_weights


def naive_value_weights(q, k, scaling, lo, tv, window):
    """``M`` from the ``[T, T]`` probabilities of every head at once, fp64 (the definition)."""
    n, h, t, _ = q.shape
    hkv = k.shape[1]
    p = causal_probs(q, k, scaling)[..., lo:, lo : lo + tv].double()  # [N, H_kv, g, T-lo, T_v]
    if window > 0:
        p = p * (torch.arange(lo, t)[:, None] - torch.arange(lo, lo + tv)[None, :] > window)
    p = p.reshape(n, hkv, -1, tv)
    return p.transpose(-1, -2) @ p / p.shape[2]


@pytest.mark.parametrize("t,lo,tv,window,block", [(96, 16, 64, 32, 16), (97, 16, 48, 0, 32), (130, 8, 112, 5, 24),
                                                  (64, 0, 64, 0, 64), (80, 16, 16, 40, 7)])
def test_value_weights_equal_the_full_product(t, lo, tv, window, block):
    torch.manual_seed(t + window)
    q, k = torch.randn(2, 6, t, 16) * 2, torch.randn(2, 2, t, 16) * 2
    got = value_weights(q, k, 0.25, lo, tv, window, block=block)
    want = naive_value_weights(q, k, 0.25, lo, tv, window)
    assert got.dtype == torch.float32 and got.shape == want.shape == (2, 2, tv, tv)
    err = (got.double() - want).abs().max()
    assert err <= 1e-6 * want.abs().max(), f"worst |M - M_ref| {err:.3g} of max {want.abs().max():.3g}"
