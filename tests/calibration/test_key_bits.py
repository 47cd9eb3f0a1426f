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


def test_read_back_is_page_keys():
    """KeyAttention's read-back (each group's |x| sorted once for every clip) is the reference quantizer's to the
    bit: both widths, channel and token keys, per-head clips."""
    h = held()
    for gran in ("channel", "token"):
        base = KVCacheLayout.default(2, 32, gran, sink=16, window=32, page_size=16)
        t = LayerTransform.identity(2, 32)
        att = KB.KeyAttention(h, t, base)
        for lay in (base, base.with_key_bits(4)):
            for clip in (torch.ones(2), torch.tensor([0.8, 0.94]), torch.tensor([0.75, 0.75])):
                want = torch.stack([KB.page_keys(lay, clip, t.k_levels)(x[:, att.c0 : att.c1]) for x in att.ks])
                got = att.read_back(lay, clip, t.k_levels)
                assert torch.equal(got, want), (gran, lay.key.bits, clip, (got - want).abs().max())
                a, b = att.errors(got), att.errors(KB.page_keys(lay, clip, t.k_levels))
                assert all(torch.equal(a[m], b[m]) for m in KB.METRICS)


def test_paged_rows_follow_the_layout_split():
    pos = torch.arange(0, 200)
    lo, hi = KB.paged_rows(LAYOUT, pos)
    for p in (0, 63, 64, 65, 80, 81, 199):
        assert int(hi[p] - lo[p]) == LAYOUT.split(p + 1)[1] * 16 and int(lo[p]) == 16, p


def test_error_is_zero_at_full_precision_and_smaller_at_four_bits():
    h, t = held(), LayerTransform.identity(2, 32, k_clip=0.8)
    assert KB.key_attention_error(h, t, LAYOUT, stored=lambda x: None) == {"kl": 0.0, "top": 0.0}
    e = KB.layer_key_errors(h, t, LAYOUT)
    assert set(e) == {2, 4}
    assert e[2]["kl"] > e[4]["kl"] > 0 and e[2]["top"] > e[4]["top"] > 0, e
    # each width's errors are those of the clips it reports (chosen against the KL), never worse than the
    # transform's own 2-bit clip or min-max 4-bit keys
    for bits, lay in ((2, LAYOUT), (4, LAYOUT.with_key_bits(4))):
        clip = torch.tensor(e[bits]["clip"])
        assert KB.key_attention_error(h, t, lay, KB.page_keys(lay, clip, t.k_levels)) == {
            m: e[bits][m] for m in KB.METRICS}, bits
        per_head = KB.KeyAttention(h, t, lay).errors(KB.page_keys(lay, clip, t.k_levels))
        assert e[bits]["heads"] == {m: per_head[m].tolist() for m in KB.METRICS}, bits
    assert e[2]["kl"] <= KB.key_attention_error(h, t, LAYOUT)["kl"]
    assert e[4]["kl"] <= KB.key_attention_error(h, t, LAYOUT, KB.page_keys(LAYOUT.with_key_bits(4), torch.ones(2),
                                                                           t.k_levels))["kl"]


def test_key_clip_fit_finds_each_heads_grid_best():
    """The descent along the grid ends at each head's best ratio of the whole grid (one minimum along it here)
    from any start, the errors it returns are the measured ones; one ratio for the layer without per_head."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 256, 32, generator=g) * 2
    q[..., :16] *= 0.05  # half the channels hardly move the scores: clipping their outliers pays
    k = torch.randn(2, 2, 256, 32, generator=g)
    k[..., :16] += (torch.rand(2, 2, 256, 16, generator=g) < 0.03) * torch.randn(2, 2, 256, 16, generator=g) * 4
    lay, t = KVCacheLayout.default(2, 32, "channel", sink=16, window=32, page_size=64), LayerTransform.identity(2, 32)
    att = KB.KeyAttention(HeldOut(q, k, torch.zeros_like(k), 32**-0.5), t, lay)
    grid = KB.clip_grid(64, KB.NARROW_CLIPS)
    table = torch.stack([att.errors(KB.page_keys(lay, torch.full((2,), r), t.k_levels))["kl"] for r in grid])
    want = torch.tensor(grid)[table.argmin(0)]
    assert grid[0] > float(want.max()) and float(want.min()) > grid[-1], table  # inside the grid
    for start in (torch.ones(2), torch.full((2,), 0.75), torch.tensor([0.99, 0.8])):  # 0.99: the rank of 1.0
        clip, err = KB.fit_key_clip(att, lay, t.k_levels, "kl", grid, start)
        assert torch.equal(clip, want), (start, clip, want, table)
        assert torch.equal(err["kl"], table.min(0).values)
        assert torch.equal(err["top"], att.errors(KB.page_keys(lay, clip, t.k_levels))["top"])
    shared, _ = KB.fit_key_clip(att, lay, t.k_levels, "kl", grid, torch.ones(2), per_head=False)
    assert shared[0] == shared[1] == grid[int(table.sum(1).argmin())]


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
    assert len(stats["errors"][2]["4"]["clip"]) == 2  # the clips measured, per KV head
    with pytest.raises(ValueError, match="key_bits_metric: expected one of"):
        KB.choose_key_bits(hs.__getitem__, ts, LAYOUT, 3.0, "mse")


def test_layer_sets_parse_ranges_and_refuse_garbage():
    assert KB.parse_layers("6-8,14, 28,7") == [6, 7, 8, 14, 28]
    assert KB.parse_layers("0") == [0] and KB.parse_layers("") == []
    for bad in ("a-3", "5-2", "-1", "1,x"):
        with pytest.raises(ValueError, match="layers: expected"):
            KB.parse_layers(bad)


def test_set_key_clips_takes_each_layers_clips_of_its_width():
    ts = [LayerTransform.identity(2, 16, 0.9, 0.8) for _ in range(3)]
    stats = {"errors": [{"2": {"clip": [0.87, 0.84]}, "4": {"clip": [1.0, 0.96]}}, None,
                        {"2": {"clip": [0.8, 0.9]}, "4": {"clip": [0.98, 1.0]}}]}
    got = KB.set_key_clips(ts, (4, 2, 2), stats)
    assert torch.equal(got[0].k_clip, torch.tensor([1.0, 0.96]))
    assert torch.equal(got[2].k_clip, torch.tensor([0.8, 0.9]))
    assert got[1] is ts[1]  # not measured (e.g. sliding): as fitted
    assert all(torch.equal(a.v_clip, b.v_clip) for a, b in zip(got, ts))
    with pytest.raises(ValueError, match=r"set_key_clips: expected one key width and one measurement per layer \(3\), "
                                         "got 2 and 3"):
        KB.set_key_clips(ts, (4, 2), stats)
