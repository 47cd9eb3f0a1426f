"""The page variants of the retrieval diagnosis (``eval/levers.py``): the 4-bit rule is the reference rule, a
variant with nothing changed is our cache bit for bit, BF16 everywhere (by swap or by anchors) is BF16 exactly,
anchors are the rows asked for, the byte counts, and bad input."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eval_helpers import LAY, CharTokenizer, random_transform, tiny_llama
from oscar_export.eval.cache_models import PagedInt2
from oscar_export.eval.levers import PageVariant, variant
from oscar_export.eval.niah import NiahConfig, build_prompts, run_niah
from oscar_export.eval.quantizers import page_roundtrip, with_side_bits
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

LAY_CH = KVCacheLayout.default(2, 64, "channel", sink=16, window=32, page_size=16)


def uniform(t: LayerTransform) -> LayerTransform:
    lv = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(t.num_kv_heads, 4).contiguous()
    return LayerTransform(**{**{f: getattr(t, f) for f in t.__dataclass_fields__}, "k_levels": lv, "v_levels": lv})


@pytest.mark.parametrize("lay", [LAY, LAY_CH], ids=["token-keys", "channel-keys"])
def test_four_bit_units_are_the_row_formats_four_bit_pages(lay):
    """Issue 17: a 4-bit unit is ``page_roundtrip`` on the 4-bit row format (``layout.with_key_bits(4)`` for keys),
    clip 1 unless ``wide_clip``; it is finer than our 2-bit pages."""
    t = uniform(random_transform())
    x = torch.randn(2, 64, 64) * 3
    ones = replace(t, k_clip=torch.ones(2), v_clip=torch.ones(2))
    ours = PagedInt2("ours", layout=lay, transforms=(t, t))
    for side in "kv":
        four = page_roundtrip(x, with_side_bits(lay, side, 4), ones, side)
        got = variant(ours, "w", units=((1, -1, side, 4),)).page_rows(1, x, side, x)
        assert torch.equal(got, four), side
        clipped = variant(ours, "w", units=((1, -1, side, 4),), wide_clip=True).page_rows(1, x, side, x)
        assert torch.equal(clipped, page_roundtrip(x, with_side_bits(lay, side, 4), t, side)), side
        assert (four - x).abs().mean() < 0.3 * (page_roundtrip(x, lay, t, side) - x).abs().mean()
    assert with_side_bits(lay, "k", 4) == lay.with_key_bits(4) and with_side_bits(lay, "v", 2) == lay


def test_plain_variant_is_our_cache_bit_for_bit():
    t = random_transform()
    ours = PagedInt2("ours", layout=LAY_CH, transforms=(t, t))
    v = variant(ours, "v")
    ks, vs = torch.randn(2, 200, 64), torch.randn(2, 200, 64)
    a, b = ours.segments(1, ks, vs, 199, 200)[0], v.segments(1, ks, vs, 199, 200)[0]
    assert torch.equal(a.k_alt, b.k_alt) and torch.equal(a.v_alt, b.v_alt)
    assert v.bits_per_element(777) == ours.bits_per_element(777)
    assert v.page_bits() == LAY_CH.int2_bits_per_element()


def _niah(methods):
    model = tiny_llama()
    cfg = NiahConfig(lengths=(640,), needles=2, tasks=("multivalue",), digits=3, values=2)
    lines = [[i % 96 for i in range(j, j + 12)] for j in range(60)]
    tok = CharTokenizer()
    rows = run_niah(model, tok, methods, build_prompts(tok, cfg, lines), cfg, store_dtype=torch.float32,
                    needle_mass=True)
    by: dict = {}
    for r in rows:
        by.setdefault(r["method"], []).append((r["answer"], r["needle_mass"]))
    return by


def test_bf16_everywhere_by_swaps_or_by_anchors_is_bf16_exactly():
    t = random_transform()
    ours = PagedInt2("ours", layout=LAY_CH, transforms=(t, t))
    full = PagedInt2("full", layout=LAY_CH, transforms=(t, t), quantize=False)
    every = variant(ours, "every-layer-bf16", units=tuple((i, -1, s, 16) for i in range(2) for s in "kv"))
    heads = variant(ours, "every-head-bf16", units=tuple((i, h, s, 16) for i in range(2) for h in range(2)
                                                          for s in "kv"))
    anchors = variant(ours, "anchors-everywhere", anchors=LAY_CH.page_size)
    one = variant(ours, "one-layer-k", units=((0, -1, "k", 16),))
    by = _niah([full, ours, every, heads, anchors, one])
    assert all(m is not None for _, m in by["full"]), "the needle mass must be measured"
    for name in ("every-layer-bf16", "every-head-bf16", "anchors-everywhere"):
        assert by[name] == by["full"], name  # answers and per-layer, per-head attention mass, exactly
    assert by["ours"] != by["full"] and by["one-layer-k"] != by["ours"], "the quantized path must be what is read"


def test_anchors_are_the_rows_asked_for_and_read_exactly():
    t = random_transform()
    ours = PagedInt2("ours", layout=LAY_CH, transforms=(t, t))
    x = torch.randn(2, 64, 64)
    x[:, 5] *= 20  # one outlier token in page 0 and one in page 2
    x[:, 37] *= 20
    # values (token groups): the outlier rows have the largest quantization error
    err = variant(ours, "e", anchors=1, anchor_sides="v").page_rows(0, x, "v", x)
    assert torch.equal(err[:, 5], x[:, 5]) and torch.equal(err[:, 37], x[:, 37])
    assert (err == x).all(-1).sum() == 2 * 4, (err == x).all(-1).nonzero().tolist()  # one row per page and head
    assert torch.equal(variant(ours, "e", anchors=1, anchor_sides="v").page_rows(0, x, "k", x),
                       ours.page_rows(0, x, "k", x))  # keys not anchored
    # keys (channel groups) by key norm: the outliers; kept out of the statistics, the other rows gain
    plain = ours.page_rows(0, x, "k", x)
    for excl in (False, True):
        out = variant(ours, "n", anchors=1, anchor_score="keynorm", anchor_exclude=excl).page_rows(0, x, "k", x)
        assert torch.equal(out[:, 5], x[:, 5]) and torch.equal(out[:, 37], x[:, 37])
        rows = [i for i in range(16) if i != 5]
        gain = (out[:, rows] - x[:, rows]).square().sum() / (plain[:, rows] - x[:, rows]).square().sum()
        assert (gain < 0.5) if excl else (gain == 1), (excl, float(gain))
    norm = variant(ours, "n", anchors=1, anchor_score="keynorm").page_rows(0, x * 0.5, "v", x)
    assert torch.equal(norm[:, 5], x[:, 5] * 0.5)  # values anchored where the same token's key norm is largest


def test_bits_per_element_of_the_levers_on_the_smollm2_layout():
    lay = KVCacheLayout.default(3, 64, "channel")
    ts = tuple(LayerTransform.identity(3, 64) for _ in range(30))
    ours = PagedInt2("ours", layout=lay, transforms=ts)
    assert lay.int2_bits_per_element() == 2.5
    v4 = variant(ours, "v4", units=tuple((i, -1, "v", 4) for i in range(15)))
    assert v4.page_bits() == pytest.approx(2.5 + 2 * 45 / 180)  # 45 of 180 units at 4.5 bits: 3.0
    assert variant(ours, "a", anchors=1).page_bits() == pytest.approx(2.5 + (16 * 64 + 8) / (64 * 64))
    assert variant(ours, "g", value_group=32).page_bits() == pytest.approx(2.75)
    assert variant(ours, "s", units=((0, 1, "k", 16),)).page_bits() == pytest.approx(2.5 + 13.5 / 180)
    sink, pages, recent = lay.split(8192)
    want = ((sink + recent) * 16 + pages * 64 * v4.page_bits()) / 8192
    assert v4.bits_per_element(8192) == pytest.approx(want)
    assert ours.bits_per_element(32768) == pytest.approx(variant(ours, "p").bits_per_element(32768))


def test_bad_variants_are_clear_errors():
    t = random_transform()
    ours = PagedInt2("ours", layout=LAY_CH, transforms=(t, t))
    with pytest.raises(ValueError, match="unit .* is not"):
        variant(ours, "x", units=((2, 0, "k", 16),))
    with pytest.raises(ValueError, match="unit .* is not"):
        variant(ours, "x", units=((0, 0, "k", 8),))
    with pytest.raises(ValueError, match="named twice"):
        variant(ours, "x", units=((0, -1, "k", 16), (0, 1, "k", 4)))
    with pytest.raises(ValueError, match="anchors: expected 0..16"):
        variant(ours, "x", anchors=17)
    with pytest.raises(ValueError, match="anchor_score"):
        variant(ours, "x", anchors=1, anchor_score="mass")
    with pytest.raises(NotImplementedError, match="float16"):
        PageVariant("x", layout=LAY, transforms=(t, t), param_dtype="float32")


def test_mixed_key_bits_model_reads_each_layer_with_its_layout():
    """``ours_method`` of an artifact with ``key_bits`` (2, 4): layer 1's K pages are the 4-bit format with its own
    clips; a plain variant is that model bit for bit; the byte counts follow the layer layouts."""
    t = uniform(random_transform())
    ours = PagedInt2("ours", layout=LAY_CH, transforms=(t, t), key_bits=(2, 4))
    ks, vs = torch.randn(2, 200, 64), torch.randn(2, 200, 64)
    seg = ours.segments(1, ks, vs, 199, 200)[0]
    c0, c1 = LAY_CH.sink, seg.c0 + seg.k_alt.shape[1]
    assert torch.equal(seg.k_alt, page_roundtrip(ks[:, c0:c1], LAY_CH.with_key_bits(4), t, "k"))
    assert torch.equal(seg.v_alt, page_roundtrip(vs[:, c0:c1], LAY_CH, t, "v"))
    assert torch.equal(ours.segments(0, ks, vs, 199, 200)[0].k_alt, page_roundtrip(ks[:, c0:c1], LAY_CH, t, "k"))
    v = variant(ours, "v")
    assert torch.equal(v.segments(1, ks, vs, 199, 200)[0].k_alt, seg.k_alt)
    assert v.unit_bits()[:, :, 0].tolist() == [[2, 2], [4, 4]]
    lays = (LAY_CH, LAY_CH.with_key_bits(4))
    assert v.page_bits() == pytest.approx(sum(x.int2_bits_per_element() for x in lays) / 2)
    assert ours.bits_per_element(777) == pytest.approx(sum(x.effective_bits_per_element(777) for x in lays) / 2)
    assert v.bits_per_element(777) == pytest.approx(ours.bits_per_element(777))
    with pytest.raises(ValueError, match=r"key_bits: expected one per layer \(2\), got 1"):
        PagedInt2("bad", layout=LAY_CH, transforms=(t, t), key_bits=(4,))


def test_ours_method_honours_the_artifacts_key_bits():
    from transformers import LlamaConfig

    from oscar_export.calibration.artifact import OscarArtifact
    from oscar_export.eval.recipes import ours_method

    art = OscarArtifact.identity(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             num_hidden_layers=2, head_dim=32, vocab_size=10)).with_key_bits([4, 2])
    m = ours_method(art)
    assert m.key_bits == (4, 2) and m.layer_layout(0) == art.layer_layout(0) and m.layer_layout(1) == art.layout
