"""``oscar_export/eval/attention.py``: the NIAH decode path (shared prefix, memoised quantization reused until
``valid_until``) gives the one-pass rows across a page demotion, a KIVI key-group flush and an HF requantization."""

from __future__ import annotations

import torch

from oscar_export.eval.attention import EvalContext, sequence_attention
from oscar_export.eval.cache_models import Kivi2, PagedInt2
from oscar_export.eval.hf_quantized import HFQuantized

from helpers import EVAL_LAYOUT, D, eval_transform


def test_decode_mode_matches_score_mode_across_demotions_and_flushes():
    """The NIAH decode path (shared prefix, memoised quantization reused until ``valid_until``) gives the
    one-pass rows, through a page demotion (pages), a key-group flush (KIVI) and a requantization (HF)."""
    t = eval_transform()
    ms = [PagedInt2("p", layout=EVAL_LAYOUT, transforms=(t,)), Kivi2("k", group=16, residual=32),
          HFQuantized("h", backend="hqq", residual=16)]
    T, n0 = 180, 140  # pages: demotion at a = 143, 159, 175; KIVI keys flush at a = 159; HF flush at 156
    q = torch.randn(4, T, D)
    k = torch.randn(2, T, D)
    v = torch.randn(2, T, D)
    for m in ms:
        ctx = EvalContext([m], "decode", torch.bfloat16, prefill_len=n0)
        ctx.prefix_k, ctx.prefix_v = {0: k[None, :, :n0]}, {0: v[None, :, :n0]}
        one = EvalContext([m], "score", torch.bfloat16, prefill_len=n0)
        full = sequence_attention(one, m, 0, 0, q, k, v, D ** -0.5)
        recomputed = 0
        for a in range(n0, T):
            before = ctx.memo[(0, 0)].segs if (0, 0) in ctx.memo else None
            o = sequence_attention(ctx, m, 0, 0, q[:, a : a + 1], k[:, n0 : a + 1], v[:, n0 : a + 1], D ** -0.5)
            recomputed += before is not None and ctx.memo[(0, 0)].segs is not before
            err = (o[:, 0] - full[:, a]).abs().max().item()
            assert err < 1e-5, f"{m.name} position {a}: {err:.3e}"
        assert recomputed >= 1, f"{m.name}: the decode path never re-quantized (valid_until unused)"
