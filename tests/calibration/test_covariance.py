"""``calibration/covariance.py``: the streamed fp64 statistics of a layer (key and value targets, key mean, the
attention-weighted value target), GQA-grouped, over two batches equal the sums over the raw captured tensors."""

from __future__ import annotations

import torch

from oscar_export.calibration.capture import Collector, run_batches
from oscar_export.calibration.covariance import causal_probs

from helpers import CAPTURE_SHAPE

L, H, HKV, D = CAPTURE_SHAPE


def test_stats_match_direct_sums(tiny):
    """Streaming fp64 sums over two batches equal sums over the raw tensors, with GQA grouping."""
    ids = torch.randint(0, 50, (4, 20))
    raw = Collector(L, HKV, D, skip=3, mode="heldout")
    run_batches(tiny, raw, [ids])
    col = Collector(L, HKV, D, skip=3)
    run_batches(tiny, col, ids.split(2))
    q, k, v = raw.heldout[1][0]
    st = col.stats[1]
    g = H // HKV
    for h in range(HKV):
        qs = q[:, h * g : (h + 1) * g, 3:].double().reshape(-1, D)
        ks = k[:, h, 3:].double().reshape(-1, D)
        vs = v[:, h, 3:].double().reshape(-1, D)
        assert torch.allclose(st.key_target()[h], qs.T @ qs / len(qs), rtol=1e-5, atol=1e-7)
        assert torch.allclose(st.key_mean()[h], ks.mean(0), rtol=1e-5, atol=1e-7)
        assert torch.allclose(st.value_target("plain")[h], vs.T @ vs / len(vs), rtol=1e-5, atol=1e-7)
        mass = causal_probs(q, k, D**-0.5, 8)[:, h].sum(dim=(1, 2))[:, 3:].double().reshape(-1)  # [B*(T-3)]
        want = (vs * mass[:, None]).T @ vs / mass.sum()
        assert torch.allclose(st.value_target("prob")[h], want, rtol=1e-4, atol=1e-7)
    assert st.tokens == 4 * 17
