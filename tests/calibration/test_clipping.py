"""The clip grid search (calibration/clipping.py): exhaustive, and screened (a cheap estimate ranks the grid, the
exact error measures each head's best ranked ratios); on planted-structure data (``helpers.planted``) the fitted
clips match or beat the global ratios."""

from __future__ import annotations

import pytest
import torch

from oscar_export.calibration.clipping import clip_grid, fit_clip
from oscar_export.calibration.rotation import rotation
from oscar_export.kernels.layout import RowFormat

from helpers import PLANTED_SHAPE, stats_and_objective

H_KV, _, D, _, _ = PLANTED_SHAPE

GRID = clip_grid(64)


def table_fn(table: torch.Tensor, calls: list):
    """``errors_fn`` of a fixed ``[R, H]`` table: each head's entry of the grid ratio its clip names."""
    grid = torch.tensor(GRID, dtype=torch.float32)

    def fn(clips):
        calls.append(torch.stack(clips))
        idx = torch.stack([(c[:, None] - grid[None]).abs().argmin(1) for c in clips])  # [len, H]
        return table.gather(0, idx)

    return fn


def test_a_screen_that_ranks_like_the_exact_error_gives_the_exhaustive_fit():
    torch.manual_seed(0)
    table = torch.rand(len(GRID), 3, dtype=torch.float64)
    for per_head in (True, False):
        full = fit_clip(table_fn(table, []), 3, GRID, per_head=per_head)
        calls: list = []
        screened = fit_clip(table_fn(table, calls), 3, GRID, per_head=per_head, screen_fn=table_fn(2 * table, []),
                            keep=2)
        assert torch.equal(screened.clip, full.clip) and torch.equal(screened.error, full.error), per_head
        assert len(calls) == 1 and calls[0].shape == (2, 3)  # only the 2 best ranked ratios, each head its own


def test_the_screen_decides_which_ratios_are_measured_and_the_exact_error_picks_among_them():
    exact = torch.tensor([[5.0, 1.0], [4.0, 2.0], [3.0, 3.0], [2.0, 4.0], [1.0, 5.0]] + [[9.0, 9.0]] * (len(GRID) - 5),
                         dtype=torch.float64)
    screen = exact.clone()
    screen[4, 0] = 8.5  # head 0's exact best ranked 4th of the screen: not measured with keep=3
    screen[1, 1] = 0.5  # head 1's second best ranked first: measured, but the exact error prefers row 0
    fit = fit_clip(table_fn(exact, []), 2, GRID, screen_fn=table_fn(screen, []), keep=3)
    assert torch.equal(fit.clip, torch.tensor([GRID[3], GRID[0]])) and fit.error.tolist() == [2.0, 1.0]
    assert fit.table[4, 0] == float("inf") and fit.table[2, 0] == 3.0  # unmeasured ratios are inf
    assert torch.isfinite(fit.table).sum(0).tolist() == [3, 3]


@pytest.mark.parametrize("keep", [len(GRID), len(GRID) + 1])
def test_keeping_the_whole_grid_is_the_exhaustive_search(keep):
    torch.manual_seed(1)
    table = torch.rand(len(GRID), 2, dtype=torch.float64)
    calls: list = []
    fit = fit_clip(table_fn(table, calls), 2, GRID, screen_fn=table_fn(-table, []), keep=keep)
    assert torch.equal(fit.table, table) and len(calls) == 1


def test_the_local_descent_finds_each_heads_minimum_of_a_one_minimum_error_and_measures_less():
    n = len(GRID)
    minima = [0, 4, 7, n - 1]  # at the grid's ends, at the middle, off it
    table = torch.stack([(torch.arange(n) - m).abs().double() + 1 + h for h, m in enumerate(minima)], 1)  # [R, H]
    calls: list = []
    fit = fit_clip(table_fn(table, calls), len(minima), GRID, local=True)
    assert torch.equal(fit.clip, torch.tensor([GRID[m] for m in minima]))
    assert fit.error.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert 0 < int(torch.isfinite(fit.table).sum(0).min()) and int(torch.isfinite(fit.table).sum(0).max()) < n
    shared = fit_clip(table_fn(table, []), len(minima), GRID, per_head=False, local=True)
    assert torch.equal(shared.clip, torch.full((4,), GRID[int(table.sum(1).argmin())]))


def test_the_local_descent_stops_in_the_minimum_it_reaches():
    """Its limit, stated: with two minima along the grid it keeps the one its descent from the middle reaches."""
    n = len(GRID)
    table = torch.full((n, 1), 5.0, dtype=torch.float64)
    table[n // 2 + 1, 0], table[0, 0] = 1.0, 0.5  # a minimum next to the middle, a lower one at the far end
    fit = fit_clip(table_fn(table, []), 1, GRID, local=True)
    assert fit.error.tolist() == [1.0] and fit_clip(table_fn(table, []), 1, GRID).error.tolist() == [0.5]


def test_milder_moves_each_heads_ratio_steps_toward_one_and_stops_there():
    from oscar_export.calibration.clipping import milder

    clip = torch.tensor([0.9, 0.98, 1.0, 0.75, 0.8999])  # the last: nearest grid ratio 0.9
    assert milder(clip, GRID, 1).tolist() == pytest.approx([0.92, 1.0, 1.0, 0.8, 0.92])
    assert milder(clip, GRID, 2).tolist() == pytest.approx([0.94, 1.0, 1.0, 0.84, 0.94])
    assert torch.equal(milder(clip, GRID, 0), torch.tensor(GRID)[[5, 1, 0, 9, 5]])


@pytest.mark.parametrize("side", ["k", "v"])
def test_fitted_clip_no_worse_than_global(side):
    st, obj = stats_and_objective()
    fmt = RowFormat(D, D)
    r = rotation("hadamard", st.key_target(), D)
    one, zero = torch.ones(H_KV, D, dtype=torch.float64), torch.zeros(H_KV, D, dtype=torch.float64)
    lv = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(H_KV, 4)
    err = obj.key_errors if side == "k" else obj.value_errors
    fn = lambda cs: err(r, one, zero, cs, lv, fmt)  # noqa: E731
    fit = fit_clip(fn, H_KV, clip_grid(D), per_head=True)
    glob = fn([torch.full((H_KV,), 0.96 if side == "k" else 0.92)])[0].double()
    assert bool((fit.error <= glob).all()), (fit.error, glob)
    assert torch.equal(fit.error_at(0.96 if side == "k" else 0.92), glob)
    shared = fit_clip(fn, H_KV, clip_grid(D), per_head=False)
    assert float(fit.error.sum()) <= float(shared.error.sum())
