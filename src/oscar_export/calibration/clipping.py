"""Clip ratios fitted on held-out rows over a grid (docs/design.md §4 "Clipping").

A clip ratio keeps the ``ceil(ratio * n) - 1``-th smallest ``|x|`` of each quantization group of ``n``
elements as the clamp threshold (``kernels.transform.clip_rank``: the research code's per-row quantile).
Groups are ``G`` elements of a row (token granularity) or the ``P`` tokens of a channel within a page
(channel granularity). Ratios that give the same rank are the same quantizer, so the grid is deduplicated
by rank. The research code's global ratios (K 0.96, V 0.92) are always in the grid: on the objective it is
fitted on, the fitted clip can only match or beat them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from oscar_export.kernels.transform import clip_rank

#: research-code global clip ratios (keys, values): the baseline.
GLOBAL_CLIP = {"k": 0.96, "v": 0.92}
DEFAULT_GRID = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.87, 0.84, 0.8, 0.75)
#: ratios a screened grid search measures exactly per head (:func:`fit_clip`): on SmolLM2 the exact best value clip
#: ranked 1st-3rd on the value screen in 359 of 360 grids, 4th in one that did not decide the fit
#: (benchmarks/RESULTS-calibrate.md).
SCREEN_KEEP = 3
#: grid steps toward 1.0 that the value clips are moved from the held-out fit (:func:`milder`). The fit minimises the
#: attention-output error on 2,048-token held-out sequences (``objective.py``); the text KL preferred milder value
#: clips: on SmolLM2's dev text (4 x 4K windows) one step lowered it at 2K / 4K from 0.00390 / 0.00510 to 0.00380 /
#: 0.00498, at 4K in every window (docs/evaluation.md, "Calibration choices on the dev split"). A likely reason, not
#: shown: over more quantized rows, rounding errors average out in the attention output and a clip's bias does not.
VALUE_CLIP_STEPS = 1


def clip_grid(group: int, ratios=DEFAULT_GRID, include=(0.96, 0.92)) -> list[float]:
    """Ratios of ``ratios`` + ``include`` with distinct clip ranks for ``group``-element groups, descending."""
    seen: dict[int, float] = {}
    for r in [float(x) for x in include] + sorted({float(x) for x in ratios}, reverse=True):
        if not 0 < r <= 1:
            raise ValueError(f"clip ratio: expected in (0, 1], got {r}")
        seen.setdefault(int(clip_rank(torch.tensor(r), group)), r)  # the baseline ratios win ties
    return sorted(seen.values(), reverse=True)


@dataclass(frozen=True)
class ClipFit:
    """Result of a grid search: ``clip [H]`` chosen ratios, ``error [H]`` their errors, ``table [R, H]``."""

    clip: torch.Tensor
    error: torch.Tensor
    grid: tuple[float, ...]
    table: torch.Tensor

    def error_at(self, ratio: float) -> torch.Tensor:
        """``[H]`` error of one grid ratio (raises if it is not on the grid)."""
        for i, r in enumerate(self.grid):
            if abs(r - ratio) < 1e-12:
                return self.table[i]
        raise KeyError(f"clip ratio {ratio} is not on the grid {self.grid}")


def fit_clip(
    errors_fn: Callable[[list[torch.Tensor]], torch.Tensor], num_heads: int, grid: list[float], per_head: bool = True,
    screen_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None, keep: int = SCREEN_KEEP,
    local: bool = False, start: torch.Tensor | None = None,
) -> ClipFit:
    """Evaluate ``errors_fn([clip [H], ...]) -> error [R, H]`` on the grid (all heads at once), pick the best.

    ``per_head``: each head its own ratio; otherwise one ratio per layer minimising the summed error.
    Two ways to measure less than the whole grid (a head's ratios side by side in one clip vector; ``table`` then
    holds ``inf`` where a ratio was not measured):

    * ``screen_fn``: a cheaper estimate of the same error (same call) ranks the grid; only each head's ``keep`` best
      ranked ratios are measured (``keep`` calls);
    * ``local``: a descent from the middle of the grid (or each head's ``start`` ``[H]`` grid index): each head's
      best ratio so far until both its grid neighbours are measured and worse (the grid's best where the error has
      one minimum along it).
    """
    if not grid:
        raise ValueError("fit_clip: empty grid")
    g = torch.tensor(grid, dtype=torch.float32)
    n = len(grid)
    if screen_fn is not None and keep < n:
        est = screen_fn([torch.full((num_heads,), r, dtype=torch.float32) for r in grid]).double()  # [R, H]
        if not per_head:
            est = est.sum(1, keepdim=True).expand(-1, num_heads)
        ranked = est.argsort(dim=0, stable=True)[:keep]  # [keep, H] grid indices, best first
        table = torch.full((n, num_heads), float("inf"), dtype=torch.float64)
        table.scatter_(0, ranked, errors_fn([g[idx] for idx in ranked]).double())
    elif local and (n > 3 or start is not None):
        table = _descend(errors_fn, num_heads, g, per_head, start)
    else:
        table = errors_fn([torch.full((num_heads,), r, dtype=torch.float32) for r in grid]).double()  # [R, H]
    if per_head:
        best = table.argmin(0)  # [H]
        return ClipFit(g[best], table.gather(0, best[None])[0], tuple(grid), table)
    i = int(table.sum(1).argmin())
    return ClipFit(g[i].expand(num_heads).clone(), table[i], tuple(grid), table)


def milder(clip: torch.Tensor, grid: list[float], steps: int) -> torch.Tensor:
    """``clip [H]`` ratios of ``grid`` (descending; each the grid ratio nearest to it) moved ``steps`` grid steps
    toward the mildest ratio ``grid[0]``, stopping there."""
    g = torch.tensor(grid, dtype=clip.dtype)
    idx = (clip[:, None] - g[None, :]).abs().argmin(1)
    return g[(idx - steps).clamp(min=0)]


def _descend(errors_fn, num_heads: int, g: torch.Tensor, per_head: bool, start: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``[R, H]`` errors of :func:`fit_clip`'s ``local`` search, ``inf`` where not measured."""
    n = len(g)
    table = torch.full((n, num_heads), float("inf"), dtype=torch.float64)
    heads = torch.arange(num_heads)
    mid = torch.full((num_heads,), n // 2) if start is None else start.long()
    todo = [(mid + s).clamp(0, n - 1) for s in (-1, 0, 1)]  # [H] grid indices per call
    while todo:
        table[torch.stack(todo), heads] = errors_fn([g[idx] for idx in todo]).double()
        score = table if per_head else table.sum(1, keepdim=True).expand(-1, num_heads)
        best = score.argmin(0)  # [H]
        steps = [(best + s).clamp(0, n - 1) for s in (-1, 1)]
        todo = [idx for idx in steps if bool(torch.isinf(table[idx, heads]).any())]
        # a head already done (or at the grid's end) measures its best again: the call serves the others
        todo = [torch.where(torch.isinf(table[idx, heads]), idx, best) for idx in todo]
    return table


__all__ = ["DEFAULT_GRID", "GLOBAL_CLIP", "SCREEN_KEEP", "VALUE_CLIP_STEPS", "ClipFit", "clip_grid", "fit_clip",
           "milder"]
