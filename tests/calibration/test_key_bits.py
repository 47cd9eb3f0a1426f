"""``calibration/key_bits.py``: the per-layer attention error of stored keys and the 4-bit key allocation."""

from __future__ import annotations

import pytest
import torch

from oscar_export.calibration import key_bits as KB
from oscar_export.calibration.capture import HeldOut
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.reference import dequantize_pages, quantize_pages
from oscar_export.kernels.transform import LayerTransform

LAYOUT = KVCacheLayout.default(2, 32, "channel", sink=16, window=32, page_size=16)


def held(n: int = 2, t: int = 128, seed: int = 0) -> HeldOut:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 4, t, 32, generator=g)
    k = torch.randn(n, 2, t, 32, generator=g) * torch.linspace(0.2, 3.0, 32)  # uneven channels
    k[:, :, 20] += 6 * q[:, ::2, -1]  # one page row most queries attend to
    return HeldOut(q, k, torch.zeros_like(k), 32**-0.5)


def test_page_keys_is_the_reference_quantizer():
    x = torch.randn(2, 3 * 16, 32)
    clip, levels = torch.tensor([0.9, 1.0]), torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2)
    for lay in (LAYOUT, LAYOUT.with_key_bits(4)):
        pages = x.reshape(2, 3, 16, 32).transpose(0, 1)
        want = dequantize_pages(*quantize_pages(pages, lay.key, clip, levels), lay.key, levels)
        assert torch.equal(KB.page_keys(lay, clip, levels)(x), want.transpose(0, 1).reshape(2, 48, 32))


def test_paged_rows_follow_the_layout_split():
    pos = torch.arange(0, 200)
    lo, hi = KB.paged_rows(LAYOUT, pos)
    for p in (0, 63, 64, 65, 80, 81, 199):
        assert int(hi[p] - lo[p]) == LAYOUT.split(p + 1)[1] * 16 and int(lo[p]) == 16, p


def test_error_is_zero_at_full_precision_and_smaller_at_four_bits():
    h, t = held(), LayerTransform.identity(2, 32)
    assert KB.key_attention_error(h, t, LAYOUT, stored=lambda x: None) == {"kl": 0.0, "top": 0.0}
    e = KB.layer_key_errors(h, t, LAYOUT)
    assert set(e) == {2, 4}
    assert e[2]["kl"] > e[4]["kl"] > 0 and e[2]["top"] > e[4]["top"] > 0, e
    # the 4-bit error is min-max (clip 1) on the 4-bit layout, whatever the 2-bit clip
    clipped = LayerTransform.identity(2, 32, k_clip=0.8)
    ones = torch.ones(2)
    assert KB.layer_key_errors(h, clipped, LAYOUT)[4] == KB.key_attention_error(
        h, clipped, LAYOUT, KB.page_keys(LAYOUT.with_key_bits(4), ones, clipped.k_levels))


def test_error_refuses_windows_without_pages_and_bad_queries():
    t = LayerTransform.identity(2, 32)
    with pytest.raises(ValueError, match="64 tokens leave no page before the last 16 queries"):
        KB.key_attention_error(held(t=64), t, LAYOUT, queries=16)
    with pytest.raises(ValueError, match=r"queries must be in \[1, 128\]"):
        KB.key_attention_error(held(), t, LAYOUT, queries=0)


def test_allocation_takes_the_largest_gains_within_the_budget():
    base, wide = LAYOUT.int2_bits_per_element(), LAYOUT.with_key_bits(4).int2_bits_per_element()
    gains = [0.1, None, 0.9, 0.5, -0.2]  # layer 1 has no pages (sliding); layer 4 is made worse by 4 bits
    one = (3 * base + wide) / 4  # one of the four paged layers at 4 bits
    assert KB.allocate_key_bits(gains, LAYOUT, one) == [2]
    assert KB.allocate_key_bits(gains, LAYOUT, one - 1e-6) == []
    assert KB.allocate_key_bits(gains, LAYOUT, (2 * base + 2 * wide) / 4) == [2, 3]
    assert KB.allocate_key_bits(gains, LAYOUT, 16.0) == [0, 2, 3]  # never a layer 4 bits make worse
    assert KB.allocate_key_bits([None, None], LAYOUT, 3.0) == []


def test_allocation_refuses_budgets_it_cannot_meet():
    assert KB.allocate_key_bits([0.1], LAYOUT, 2.0) == []  # below 2-bit pages: nothing fits
    with pytest.raises(ValueError, match="expected a finite number"):
        KB.allocate_key_bits([0.1], LAYOUT, float("nan"))
    with pytest.raises(ValueError, match="2 bits per element is below the 3.5 of this model's 2-bit pages"):
        KB.choose_key_bits(lambda i: held(), [LayerTransform.identity(2, 32)], LAYOUT, 2.0)


def test_choose_key_bits_measures_every_paged_layer():
    hs = [held(seed=i) for i in range(3)]
    ts = [LayerTransform.identity(2, 32) for _ in range(3)]
    wide = LAYOUT.with_key_bits(4).int2_bits_per_element()
    bits, stats = KB.choose_key_bits(hs.__getitem__, ts, LAYOUT, wide, "top", skip=(1,))
    assert bits == (4, 2, 4) and stats["layers"] == [0, 2] and stats["errors"][1] is None
    assert stats["errors"][0]["2"]["top"] > stats["errors"][0]["4"]["top"]
    with pytest.raises(ValueError, match="key_bits_metric: expected one of"):
        KB.choose_key_bits(hs.__getitem__, ts, LAYOUT, 3.0, "mse")


def test_layer_sets_parse_ranges_and_refuse_garbage():
    assert KB.parse_layers("6-8,14, 28,7") == [6, 7, 8, 14, 28]
    assert KB.parse_layers("0") == [0] and KB.parse_layers("") == []
    for bad in ("a-3", "5-2", "-1", "1,x"):
        with pytest.raises(ValueError, match="layers: expected"):
            KB.parse_layers(bad)


def test_widen_keys_sets_clip_one_only_where_the_width_differs():
    lay = KVCacheLayout.default(2, 16, "channel", sink=4, window=16, page_size=16)
    ts = [LayerTransform.identity(2, 16, 0.9, 0.8) for _ in range(3)]
    got = KB.widen_keys(ts, (4, 2, 4), lay)
    assert torch.equal(got[0].k_clip, torch.ones(2)) and torch.equal(got[2].k_clip, torch.ones(2))
    assert got[1] is ts[1]
    assert all(torch.equal(a.v_clip, b.v_clip) for a, b in zip(got, ts))
    with pytest.raises(ValueError):
        KB.widen_keys(ts, (4, 2), lay)
