"""``oscar_export/eval/hf_quantized.py``: the HF QuantizedCache replay: its flush schedule, and its attention against
the real ``QuantizedLayer`` fed token by token (its bits and bad input beside the other cache models':
test_cache_models.py)."""

from __future__ import annotations

import pytest
import torch

from oscar_export.eval.attention import EvalContext, sequence_attention
from oscar_export.eval.hf_quantized import HFQuantized, hf_flushes, hf_quantized_count
from oscar_export.kernels import reference as ref

from helpers import D

# ---- the HF QuantizedCache replay against the real layer fed token by token ---------------------------------------


def test_hf_flush_schedule():
    # transformers flushes when residual + new >= R: tokens 1..3 wait, token 4 triggers (0..4 quantized)
    assert hf_flushes(1, 10, 4) == [(1, 1), (5, 5), (9, 9)]
    assert hf_quantized_count(1, 10, 4) == 9
    assert hf_flushes(5, 6, 4) == [(5, 5)]


@pytest.mark.parametrize("backend,nbits", [("hqq", 2), ("hqq", 4), pytest.param("quanto", 2, marks=pytest.mark.slow)])
def test_hf_replay_matches_real_quantized_layer(backend, nbits):
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = HQQQuantizedLayer if backend == "hqq" else QuantoQuantizedLayer
    m = HFQuantized("hf", backend=backend, nbits=nbits, residual=8)
    T = 40
    q = torch.randn(4, T, D)
    k = torch.randn(2, T, D)
    v = torch.randn(2, T, D)
    got = sequence_attention(EvalContext([m], "score", torch.float32), m, 0, 0, q, k, v, D ** -0.5)
    real = cls(nbits=nbits, q_group_size=64, residual_length=8)
    worst = 0.0
    for a in range(T):
        kk, vv = real.update(k[None, :, a : a + 1], v[None, :, a : a + 1])
        o = ref.masked_attention(q[None, :, a : a + 1], kk, vv, torch.ones(1, 1, a + 1, dtype=torch.bool), D ** -0.5)
        worst = max(worst, (o[0, :, 0] - got[:, a]).abs().max().item())
    assert worst < 2e-5, f"worst |replay - real QuantizedLayer| = {worst:.3e}"
