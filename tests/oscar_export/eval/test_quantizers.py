"""``oscar_export/eval/quantizers.py``: the research recipe's fp32 page params against the reference's fp16 ones."""

from __future__ import annotations

import torch

from oscar_export.kernels.transform import LayerTransform

from helpers import EVAL_LAYOUT, D


def test_fp32_params_equal_the_reference_where_fp16_is_exact():
    """Groups spanning exactly 3 with integer minimum: fp16 and fp32 params are the same numbers, so the fp32
    variant must give the reference's output bit for bit; on generic data they differ."""
    from oscar_export.eval.quantizers import page_roundtrip

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (2, 32, D), generator=g).float()
    x[..., 0], x[..., 1] = 0.0, 3.0  # every 64-group spans 0..3
    x = x + torch.randint(-5, 5, (2, 32, 1), generator=g).float()
    t = LayerTransform.identity(2, D)
    a = page_roundtrip(x, EVAL_LAYOUT, t, "k", "float16")
    b = page_roundtrip(x, EVAL_LAYOUT, t, "k", "float32")
    assert torch.equal(a, b) and torch.equal(a, x)
    y = torch.randn(2, 32, D, generator=g)
    lay = EVAL_LAYOUT
    assert not torch.equal(page_roundtrip(y, lay, t, "k", "float16"), page_roundtrip(y, lay, t, "k", "float32"))
