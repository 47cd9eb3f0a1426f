"""One quantization group along the last axis: the quantizer's rounding rule, stated once.

Quantization of one group ``x`` (docs/design.md §3.1), bit-exact in every implementation:

    thr   = sorted(|x|)[rank]                      rank = clip_rank(ratio, len(x)); ratio 1 -> max
    xc    = clamp(x, -thr, thr)
    scale = fp16((max(xc) - min(xc)) * fp32(1/3));  lo = fp16(min(xc))
    d     = xc - float(lo)
    code  = [d >= t0 * s] + [d >= t1 * s] + [d >= t2 * s],  t_j = (levels[j] + levels[j+1]) / 2, s = float(scale)
    x_hat = float(lo) + float(scale) * levels[code]

No division anywhere, so torch and Triton agree to the bit. The same rule with ``2**b`` levels (``levels``
of length ``2**b``, ``1/3`` replaced by ``fp32(1 / (2**b - 1))``, :func:`span_inverse`) is the ``b``-bit quantizer:
the 4-bit key pages of ``RowFormat.bits == 4`` (uniform levels ``0..15``, ``page_quant.format_levels``) and the
evaluation's wider-code levers.
"""

from __future__ import annotations

import struct

import torch

from ..layout import ONE_THIRD_F32


def quantize_groups(
    x: torch.Tensor, rank: torch.Tensor, levels: torch.Tensor, sorted_abs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups along the last axis.

    Args:
        x: ``[..., n]`` float32 (the group is the last axis).
        rank: long, broadcastable to ``[..., 1]``: clip rank (see :func:`clip_rank`).
        levels: ``[..., n_levels]`` float32 broadcastable, ascending code levels (4 for the 2-bit format).
        sorted_abs: ``|x|`` sorted along the last axis, where the caller has it (calibration quantizes the same
            groups at every clip rank of its grid: one sort, not one a rank).
    Returns:
        codes ``[..., n]`` uint8, scale ``[...]`` fp16, lo ``[...]`` fp16.
    """
    x = x.float()
    if sorted_abs is None:
        thr = clip_threshold(x.abs(), rank)
    else:
        thr = torch.gather(sorted_abs, -1, rank.expand(*x.shape[:-1], 1))
    xc = torch.minimum(torch.maximum(x, -thr), thr)
    lo = xc.amin(dim=-1, keepdim=True)
    hi = xc.amax(dim=-1, keepdim=True)
    n_levels = levels.shape[-1]
    scale16 = ((hi - lo) * span_inverse(n_levels)).to(torch.float16)
    lo16 = lo.to(torch.float16)
    s = scale16.float()
    d = xc - lo16.float()
    lv = levels.float()
    t = (lv[..., :-1] + lv[..., 1:]) * 0.5  # [..., n_levels - 1]
    codes = (d >= t[..., 0:1] * s).to(torch.uint8)
    for j in range(1, n_levels - 1):  # static: 3 comparisons for the 2-bit format
        codes = codes + (d >= t[..., j : j + 1] * s).to(torch.uint8)
    return codes, scale16.squeeze(-1), lo16.squeeze(-1)


def clip_threshold(a: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """``sorted(a)[rank]`` along the last axis, ``[..., 1]``: the clip threshold of :func:`quantize_groups`.

    On the CPU outside compilation (a host read is free there) it is read from the ``n - min(rank)`` largest
    values (``topk``, the same element: about 3x cheaper than the full sort for the usual clips 0.9-1); elsewhere
    from the full sort (static shapes, no host read)."""
    n = a.shape[-1]
    idx = rank.expand(*a.shape[:-1], 1)
    if a.is_cuda or torch.compiler.is_compiling():
        return torch.gather(a.sort(dim=-1).values, -1, idx)
    top = a.topk(n - int(rank.min()), dim=-1).values  # descending: sorted(a)[r] is top[n - 1 - r]
    return torch.gather(top, -1, n - 1 - idx)


def span_inverse(n_levels: int) -> float:
    """fp32 of ``1 / (n_levels - 1)``, the factor the quantizer multiplies the group's range by
    (``ONE_THIRD_F32`` for the 2-bit format's 4 levels)."""
    if n_levels < 2:
        raise ValueError(f"levels: expected at least 2, got {n_levels}")
    return ONE_THIRD_F32 if n_levels == 4 else struct.unpack("f", struct.pack("f", 1.0 / (n_levels - 1)))[0]


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, levels: torch.Tensor
) -> torch.Tensor:
    """``lo + scale * levels[code]`` in float32; ``codes [..., n]``, ``scale``/``lo`` ``[...]``, ``levels [..., 4]``."""
    lv = levels.float().expand(*codes.shape[:-1], levels.shape[-1])
    val = torch.gather(lv, -1, codes.long())
    return lo.float().unsqueeze(-1) + scale.float().unsqueeze(-1) * val
