"""``calibration/codebook.py``: the positions are where the reference quantizer puts each element, Lloyd-Max finds
planted levels and keeps them ordered, and fitted levels lower the round-trip error of real pages."""

from __future__ import annotations

import pytest
import torch

from oscar_export.calibration.codebook import MIN_GAP, lloyd_levels, normalized_positions, uniform_levels
from oscar_export.kernels.layout import UNIFORM_LEVELS, RowFormat
from oscar_export.kernels.reference import dequantize_pages, quantize_pages
from oscar_export.kernels.reference.packing import unpack_page_codes

N, H, P, D, G = 3, 2, 16, 32, 16


def cells(u: torch.Tensor) -> torch.Tensor:
    """The uniform quantizer's code of a position: its midpoint cell."""
    return (u >= 0.5).long() + (u >= 1.5).long() + (u >= 2.5).long()


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("clip", [1.0, 0.8])
def test_positions_are_where_the_quantizer_puts_each_element(granularity, clip):
    """Per head, the midpoint cells of the positions are the codes ``quantize_pages`` gives (as a histogram: the
    order of the ``M`` positions is the function's own), all within ``[0, 3]``."""
    torch.manual_seed(0)
    x = torch.randn(N, H, P, D) * torch.tensor([1.0, 3.0]).view(1, H, 1, 1)
    fmt = RowFormat(D, G, granularity)
    clips = torch.full((H,), clip)
    u = normalized_positions(x, fmt, clips)
    assert u.shape == (H, N * P * D) and torch.isfinite(u).all() and u.min() >= 0 and u.max() <= 3
    packed, _ = quantize_pages(x, fmt, clips, uniform_levels(H))
    codes = unpack_page_codes(packed, fmt).long()  # [N, H, P, D]
    for h in range(H):
        want = torch.bincount(codes[:, h].reshape(-1), minlength=4)
        got = torch.bincount(cells(u[h]), minlength=4)
        assert torch.equal(got, want), (granularity, clip, h, got.tolist(), want.tolist())


def test_a_group_without_range_has_no_position():
    x = torch.randn(1, 1, P, D)
    x[0, 0, 0, :G] = 0.5  # one token group of equal values
    u = normalized_positions(x, RowFormat(D, G, "token"), torch.ones(1))
    assert int(torch.isnan(u).sum()) == G


def test_lloyd_finds_planted_levels_and_ignores_missing_positions():
    """Four tight clusters per head: the levels are the cluster means; NaN positions (groups without range) are
    dropped; a head with fewer than 16 positions keeps the uniform levels."""
    offsets = torch.linspace(-0.04, 0.04, 25)
    planted = torch.tensor([[0.2, 1.1, 1.9, 2.8], [0.0, 0.7, 2.2, 3.0]])
    u = torch.stack([(c.view(4, 1) + offsets).clamp(0, 3).reshape(-1) for c in planted])
    levels = lloyd_levels(torch.cat([u, torch.full((2, 7), float("nan"))], 1))
    want = torch.stack([(c.view(4, 1) + offsets).clamp(0, 3).mean(1) for c in planted])
    torch.testing.assert_close(levels, want, rtol=0, atol=1e-6)
    few = lloyd_levels(torch.tensor([[0.3] * 15]))
    assert torch.equal(few, torch.tensor([UNIFORM_LEVELS]))


def test_lloyd_levels_ascend_by_min_gap_within_range_and_lower_the_distortion():
    torch.manual_seed(1)
    u = torch.stack([3 * torch.rand(4000) ** 3, 1.5 + 0.4 * torch.randn(4000).clamp(-3.7, 3.7)])
    levels = lloyd_levels(u)
    assert levels.shape == (2, 4) and levels.min() >= 0 and levels.max() <= 3
    assert (levels[:, 1:] - levels[:, :-1] >= MIN_GAP - 1e-6).all(), levels

    def distortion(lv):  # midpoint cells: each position read back as its nearest level
        return ((u.unsqueeze(-1) - lv.unsqueeze(1)) ** 2).amin(-1).mean(1)

    fitted, uniform = distortion(levels), distortion(uniform_levels(2))
    assert (fitted < 0.8 * uniform).all(), (fitted, uniform)
    close = lloyd_levels(torch.tensor([[1.49] * 20 + [1.5] * 20]))  # two cells' means 0.01 apart
    torch.testing.assert_close(close, torch.tensor([[0.0, 1.49, 1.49 + MIN_GAP, 3.0]]), rtol=0, atol=1e-6)


def test_fitted_levels_lower_the_round_trip_error_of_gaussian_pages():
    """End to end through the reference quantizer: the levels fitted on the positions of Gaussian pages (most
    elements near the middle of their group's range) reconstruct those pages better than the uniform levels."""
    torch.manual_seed(2)
    x = torch.randn(8, H, P, D)
    fmt, clips = RowFormat(D, G, "token", codebook=True), torch.ones(H)
    fitted = lloyd_levels(normalized_positions(x, fmt, clips))

    def error(levels):
        codes, params = quantize_pages(x, fmt, clips, levels)
        return ((dequantize_pages(codes, params, fmt, levels) - x) ** 2).mean()

    assert error(fitted) < 0.9 * error(uniform_levels(H)), (error(fitted), error(uniform_levels(H)))


def test_uniform_levels():
    lv = uniform_levels(3)
    assert torch.equal(lv, torch.tensor([UNIFORM_LEVELS] * 3)) and lv.is_contiguous()
