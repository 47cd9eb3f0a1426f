"""A fitted non-uniform 4-level codebook at the same bits (docs/design.md §4 "Free improvements").

The reference quantizer reads a group back as ``lo + scale * levels[code]`` with ``scale = (hi - lo) / 3``
and picks codes by the midpoints between levels, so a codebook is four numbers in ``[0, 3]`` per KV head.
:func:`lloyd_levels` fits them Lloyd-Max style (alternate midpoint cells and cell means) to the positions
``u = (x_clipped - lo) / scale`` of the calibration rows; whether the fitted levels are kept is decided by
the attention-aware objective (``objective.py``), not by this MSE proxy.
"""

from __future__ import annotations

import torch

from oscar_export.kernels.layout import UNIFORM_LEVELS, RowFormat
from oscar_export.kernels.reference import quantize_groups
from oscar_export.kernels.transform import clip_rank

#: smallest gap kept between consecutive fitted levels (levels stay strictly ascending).
MIN_GAP = 0.05


def normalized_positions(x: torch.Tensor, fmt: RowFormat, clip: torch.Tensor) -> torch.Tensor:
    """Positions of every element inside its group's ``[lo, hi]`` range, in units of ``scale``.

    Args:
        x: ``[N, H_kv, P, D]`` pages in the stored basis; clip: ``[H_kv]`` ratios.
    Returns:
        ``[H_kv, M]`` fp32 in ``[0, 3]`` (groups with zero range are dropped per head by giving them NaN,
        then removed by :func:`lloyd_levels`).
    """
    n, h, p, d = x.shape
    if fmt.granularity == "token":
        grp = x.float().reshape(n, h, p, d // fmt.group_size, fmt.group_size)
        rank = clip_rank(clip, fmt.group_size).view(1, h, 1, 1, 1)
        lv = torch.tensor(UNIFORM_LEVELS).view(1, 1, 1, 1, 4)
    else:
        grp = x.float().transpose(-1, -2)  # [N, H, D, P]
        rank = clip_rank(clip, p).view(1, h, 1, 1)
        lv = torch.tensor(UNIFORM_LEVELS).view(1, 1, 1, 4)
    _, scale, lo = quantize_groups(grp, rank, lv)
    s = scale.float().unsqueeze(-1)
    u = ((grp - lo.float().unsqueeze(-1)) / s).clamp(0, 3)
    u = torch.where(s > 0, u, torch.nan)
    return u.transpose(0, 1).reshape(h, -1)


def lloyd_levels(u: torch.Tensor, iters: int = 25) -> torch.Tensor:
    """``[H, 4]`` fp32 levels minimising ``E (u - level)^2`` with midpoint cells, from ``u [H, M]``."""
    out = []
    for row in u:
        row = row[torch.isfinite(row)].double()
        lv = torch.tensor(UNIFORM_LEVELS, dtype=torch.float64)
        if row.numel() < 16:
            out.append(lv.float())
            continue
        for _ in range(iters):
            t = (lv[:-1] + lv[1:]) / 2
            cell = (row[:, None] >= t[None, :]).sum(1)  # 0..3
            sums = torch.zeros(4, dtype=torch.float64).index_add_(0, cell, row)
            cnt = torch.zeros(4, dtype=torch.float64).index_add_(0, cell, torch.ones_like(row))
            lv = torch.where(cnt > 0, sums / cnt.clamp_min(1), lv).clamp(0, 3)
        for j in range(1, 4):  # strictly ascending
            lv[j] = torch.maximum(lv[j], lv[j - 1] + MIN_GAP)
        lv = lv.clamp(max=3.0)
        for j in range(2, -1, -1):
            lv[j] = torch.minimum(lv[j], lv[j + 1] - MIN_GAP)
        out.append(lv.float())
    return torch.stack(out)


def uniform_levels(num_heads: int) -> torch.Tensor:
    return torch.tensor(UNIFORM_LEVELS).expand(num_heads, 4).contiguous()


__all__ = ["MIN_GAP", "lloyd_levels", "normalized_positions", "uniform_levels"]
