"""The portable decode backend (kernels/decode/portable.py): Triton mixed-precision paged decode attention against
an fp64 evaluation of ``reference.gather_context``.

Error budget (flash-attention's rule; ``helpers.check_attention_budget``): on the same packed cache,
the kernel's max error against fp64 must be at most 2x the max error of a BF16 PyTorch computation of the same
attention, plus 1e-5.
Shapes: the boundary lengths of tests/helpers.py in one ragged batch, GQA ratios 1/3/4/8, head_dim 64/128,
both key granularities, fitted codebooks, the fused query rotation, split counts; two token groups per row
(head_dim 128 with G 64, head_dim 256 with G 128: Gemma 3).
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, PagedKV, RowFormat
from oscar_export.kernels.transform import LayerTransform

from helpers import BOUNDARY_LENGTHS, GQA_SHAPES, HEAD_DIMS, check_attention_budget, ragged_cache


def _fitted_rotated_transform(hkv: int, d: int) -> LayerTransform:
    """A random rotation and scaling of the keys and fitted (non-uniform) levels: the serving path's uncommon case."""
    ident = LayerTransform.identity(hkv, d, 0.9, 0.9)
    return LayerTransform(
        k_rotation=torch.linalg.qr(torch.randn(hkv, d, d))[0].contiguous(), v_rotation=ident.v_rotation,
        k_scale=torch.rand(hkv, d) + 0.5, v_scale=ident.v_scale, k_mean=ident.k_mean, v_mean=ident.v_mean,
        k_clip=ident.k_clip, v_clip=ident.v_clip,
        k_levels=torch.tensor([[0.0, 0.7, 2.1, 3.0], [0.0, 1.2, 1.9, 3.0]]),  # 4-bit keys ignore them
        v_levels=torch.tensor([[0.0, 0.9, 2.2, 3.0], [0.0, 1.0, 2.0, 3.0]]),
    )


def _check_rotated(da, device, lay: KVCacheLayout, tr: LayerTransform, hq: int, what: str):
    """Model-basis queries rotated once (``transform_queries``, as the step's append launch does) over a cache
    written with a rotated, scaled key basis, within budget of the stored-basis reference; returns ``(q_stored,
    st, dev_st, levels)`` for further launches on the same cache."""
    d = lay.head_dim
    st = ragged_cache(lay, [200, 500], tr)
    q_model = torch.randn(2, hq, d)
    q_stored = tr.transform_queries(q_model[:, :, None]).squeeze(2)
    dev_st = PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__})
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    got = da.decode_attention(q_stored.to(device), dev_st, lay, *lv, d**-0.5, pages_per_split=2)
    check_attention_budget(got, q_stored, st, lay, tr, d**-0.5, what)
    return q_stored, st, dev_st, lv


def _layout(h_kv: int, d: int, gran: str, **kw) -> KVCacheLayout:
    return KVCacheLayout.default(h_kv, d, gran, **kw)


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_boundary_lengths_ragged_batch(da, device, gran):
    """Half the boundary lengths per granularity (interpreter time), one KV head of 3 query heads."""
    lay = _layout(1, 64, gran)  # S0 64, W 256, P 64: the grid BOUNDARY_LENGTHS is built around
    tr = LayerTransform.identity(1, 64, k_clip=0.96, v_clip=0.92)
    lengths = [0] + BOUNDARY_LENGTHS[gran == "channel"::2]  # an empty sequence too: zeros, like the reference
    st = ragged_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), 3, 64)
    scale = 64**-0.5
    got = da.decode_attention(q.to(device), PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__}),
                              lay, tr.k_levels.to(device), tr.v_levels.to(device), scale, pages_per_split=4)
    assert torch.equal(got[0].cpu(), torch.zeros(3, 64)), "an empty sequence must give zeros"
    check_attention_budget(got, q, st, lay, tr, scale, f"boundary {gran}")


@pytest.mark.parametrize("hq,hkv", GQA_SHAPES)
@pytest.mark.parametrize("d", [pytest.param(d, marks=pytest.mark.slow) if d > 64 else d for d in HEAD_DIMS])
def test_gqa_and_head_dims(da, device, hq, hkv, d):
    gran = "channel" if (hq // hkv + d) % 2 else "token"  # both granularities over the grid, half the time
    if (hq, hkv) == (8, 2):
        gran = "token" if d == 64 else "channel"
    lay = _layout(hkv, d, gran, sink=16, window=32)
    tr = LayerTransform.identity(hkv, d, k_clip=0.95, v_clip=0.9)
    p = lay.page_size
    lengths = [3, 16 + 32 + p + 1, 16 + 32 + 3 * p + 17]
    st = ragged_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), hq, d) * 2
    dev_st = PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__})
    got = da.decode_attention(q.to(device), dev_st, lay, tr.k_levels.to(device), tr.v_levels.to(device), d**-0.5,
                              pages_per_split=1, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    check_attention_budget(got.float(), q, st, lay, tr, d**-0.5, f"gqa {hq}/{hkv} d={d} {gran}")


@pytest.mark.slow  # ~20 s each in the interpreter: codebooks and rotated keys are the less common paths
@pytest.mark.parametrize("gran", ["token", "channel"])
def test_codebook_rotation_and_splits(da, device, gran):
    """Fitted levels, a rotated key basis, and the split count not changing the result."""
    hkv, hq, d = 2, 8, 64
    lay = KVCacheLayout(hkv, d, RowFormat(d, d, gran, codebook=True), RowFormat(d, d, codebook=True),
                        sink=16, window=32, page_size=64)
    tr = _fitted_rotated_transform(hkv, d)
    q_stored, st, dev_st, lv = _check_rotated(da, device, lay, tr, hq, f"codebook+rotation {gran}")
    outs = [da.decode_attention(q_stored.to(device), dev_st, lay, *lv, d**-0.5, pages_per_split=n) for n in (1, 64)]
    for n, o in zip((1, 64), outs):  # the split count moves the softmax max, so fp16 roundings of p differ
        check_attention_budget(o, q_stored, st, lay, tr, d**-0.5, f"codebook {gran} pages_per_split={n}")


@pytest.mark.parametrize("gran,codebook,hq", [("token", False, 6), ("channel", False, 2),
                                              pytest.param("token", True, 8, marks=pytest.mark.slow)])
def test_page_slots_kernel(da, device, gran, codebook, hq):
    """``page_slots`` pages per loop iteration (1, 2 = the default, 4) within budget, with a split whose
    last iteration is partly empty (5 pages per split), GQ 3 padded to 4, GQ 1 and 4, and an empty row."""
    hkv, d = 2, 64
    lay = KVCacheLayout(hkv, d, RowFormat(d, d, gran, codebook=codebook), RowFormat(d, d, codebook=codebook),
                        sink=16, window=32, page_size=64)
    tr = LayerTransform.identity(hkv, d, k_clip=0.95, v_clip=0.9)
    if codebook:
        tr = LayerTransform(**{**{f: getattr(tr, f) for f in tr.__dataclass_fields__},
                               "k_levels": torch.tensor([[0.0, 0.7, 2.1, 3.0], [0.0, 1.2, 1.9, 3.0]]),
                               "v_levels": torch.tensor([[0.0, 0.9, 2.2, 3.0], [0.0, 1.0, 2.0, 3.0]])})
    lengths = [0, 16 + 32 + 64 * 7 + 5, 16 + 32 + 64 + 1]
    st = ragged_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), hq, d) * 2
    dev_st = PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__})
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    for kw in (dict(page_slots=1, num_warps=1), dict(page_slots=2, num_warps=2), dict(page_slots=4, num_warps=4)):
        got = da.decode_attention(q.to(device), dev_st, lay, *lv, d**-0.5, pages_per_split=5, **kw)
        assert torch.equal(got[0].cpu(), torch.zeros(hq, d)), "an empty sequence must give zeros"
        check_attention_budget(got, q, st, lay, tr, d**-0.5, f"{kw} {gran} codebook={codebook}")


@pytest.mark.parametrize("d,g,hq,hkv,gran", [(128, 64, 8, 2, "token"), (256, 128, 4, 2, "token"),
                                              (256, 128, 4, 1, "token"), (128, 64, 8, 2, "channel"),
                                              (256, 128, 4, 2, "channel")])
def test_two_groups_per_row(da, device, d, g, hq, hkv, gran):
    """``G < D`` (Gemma 3: head_dim 256, two groups of 128 per row) within budget, token or channel keys (the
    packing groups then only order the bytes): the default layout (P = G) over boundary lengths, an empty row,
    GQ 2 and 4, page slots 1/2/4 and split counts."""
    lay = KVCacheLayout(hkv, d, RowFormat(d, g, gran), RowFormat(d, g), sink=64, window=256, page_size=g)
    tr = LayerTransform.identity(hkv, d, k_clip=0.95, v_clip=0.9)
    p = lay.page_size
    lengths = [0, 1, 64 + 256 + p + 1, 64 + 256 + 4 * p + 17]
    st = ragged_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), hq, d) * 2
    dev_st = PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__})
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    for kw in (dict(pages_per_split=3), dict(pages_per_split=5, page_slots=4, num_warps=4),
               dict(pages_per_split=1, page_slots=1, num_warps=1)):
        got = da.decode_attention(q.to(device), dev_st, lay, *lv, d**-0.5, **kw)
        assert torch.equal(got[0].cpu(), torch.zeros(hq, d)), "an empty sequence must give zeros"
        check_attention_budget(got, q, st, lay, tr, d**-0.5, f"d={d} g={g} {hq}/{hkv} {gran} {kw}")


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_two_groups_codebook_and_rotation(da, device, gran):
    """``G < D`` with fitted levels and a rotated key basis (queries rotated once, as serving does)."""
    hkv, hq, d, g = 2, 4, 128, 64
    lay = KVCacheLayout(hkv, d, RowFormat(d, g, gran, codebook=True), RowFormat(d, g, codebook=True),
                        sink=16, window=32, page_size=64)
    _check_rotated(da, device, lay, _fitted_rotated_transform(hkv, d), hq,
                   f"two groups, codebook + rotation, {gran} keys")


# ---- 4-bit key pages (layout.with_key_bits(4)): values stay 2-bit ------------------------------------------------


@pytest.mark.parametrize("gran,hq,hkv,d,g", [("token", 9, 3, 64, 64), ("channel", 8, 2, 64, 64),
                                             ("token", 16, 2, 64, 64), ("token", 8, 2, 128, 64),
                                             ("channel", 4, 2, 128, 64)])
def test_4bit_keys_within_budget(da, device, gran, hq, hkv, d, g):
    """4-bit key pages within budget: both granularities, GQ 2/3/4/8, one and two groups per row, an empty row,
    page slots 1 and 2 over a partly empty last iteration."""
    lay = KVCacheLayout(hkv, d, RowFormat(d, g, gran), RowFormat(d, g), sink=16, window=32, page_size=64)
    lay = lay.with_key_bits(4)
    tr = LayerTransform.identity(hkv, d, k_clip=0.95, v_clip=0.9)
    lengths = [0, 3, 16 + 32 + 64 + 1, 16 + 32 + 5 * 64 + 17]
    st = ragged_cache(lay, lengths, tr)
    assert st.k_codes.shape[-1] == d // 2 and int(ref.unpack_codes(st.k_codes, g, 4).max()) > 3
    q = torch.randn(len(lengths), hq, d) * 2
    dev_st = PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__})
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    for kw in (dict(pages_per_split=3), dict(pages_per_split=1, page_slots=1, num_warps=1)):
        got = da.decode_attention(q.to(device), dev_st, lay, *lv, d**-0.5, **kw)
        assert torch.equal(got[0].cpu(), torch.zeros(hq, d)), "an empty sequence must give zeros"
        check_attention_budget(got, q, st, lay, tr, d**-0.5, f"4-bit keys {gran} d={d} g={g} {hq}/{hkv} {kw}")


@pytest.mark.parametrize("gran,d,g", [("token", 64, 64), ("channel", 128, 64)])
def test_4bit_keys_codebook_values_and_rotation(da, device, gran, d, g):
    """4-bit keys read with their uniform levels while the values have a fitted codebook (the kernel's codebook
    flag then covers values only), a rotated key basis."""
    hkv, hq = 2, 4
    lay = KVCacheLayout(hkv, d, RowFormat(d, g, gran, bits=4), RowFormat(d, g, codebook=True),
                        sink=16, window=32, page_size=64)
    _check_rotated(da, device, lay, _fitted_rotated_transform(hkv, d), hq,
                   f"4-bit keys, codebook values + rotation, {gran}")


# ---- bad input: raised before any launch ---------------------------------------------------------------------


def test_bad_inputs_raise(da, device):
    lay = _layout(2, 64, "token", sink=16, window=32)
    tr = LayerTransform.identity(2, 64)
    st = PagedKV.allocate(lay, 2, 4, 2, device=device)
    q = torch.randn(2, 4, 64, device=device)
    kl, vl = tr.k_levels.to(device), tr.v_levels.to(device)
    call = lambda **kw: da.decode_attention(**{**dict(q=q, state=st, layout=lay, k_levels=kl, v_levels=vl,  # noqa: E731
                                                      scale=0.125), **kw})
    with pytest.raises(ValueError, match=r"q: expected \[B, H, D\]"):
        call(q=q[:, :, None])
    with pytest.raises(ValueError, match="q: expected float32"):
        call(q=q.to(torch.int32))
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        call(q=q[:, :3].contiguous())
    with pytest.raises(ValueError, match="q: expected a contiguous"):
        call(q=q.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="q: expected head_dim 64"):
        call(q=q[..., :32].contiguous())
    with pytest.raises(ValueError, match="k_levels: expected shape"):
        call(k_levels=kl[:1])
    with pytest.raises(ValueError, match="scale: expected a positive"):
        call(scale=float("nan"))
    with pytest.raises(ValueError, match="pages_per_split"):
        call(pages_per_split=0)
    with pytest.raises(ValueError, match="page_slots: expected a power of two, got 3"):
        call(page_slots=3)
    with pytest.raises(ValueError, match="device"):
        call(k_levels=kl.to("meta"))
    for field, bad in (("block_table", st.block_table.long()), ("sink_k", st.sink_k.float()),
                       ("recent_v", st.recent_v[:1]), ("k_params", st.k_params.float())):
        broken = PagedKV(**{**{f: getattr(st, f) for f in st.__dataclass_fields__}, field: bad})
        with pytest.raises(ValueError, match=f"state.{field}"):
            call(state=broken)
    with pytest.raises(NotImplementedError, match="head_dim 64, 128 or 256"):
        small = _layout(2, 32, "token")
        call(layout=small, state=PagedKV.allocate(small, 2, 4, 2, device=device),
             q=torch.randn(2, 4, 32, device=device))
    for bad in (KVCacheLayout(2, 128, RowFormat(128, 32, "channel"), RowFormat(128, 32), page_size=64),
                KVCacheLayout(2, 128, RowFormat(128, 32), RowFormat(128, 32), page_size=64)):
        with pytest.raises(NotImplementedError, match=r"group_size must equal head_dim \(128\) or be >= 64, got 32"):
            call(layout=bad, state=PagedKV.allocate(bad, 2, 4, 2, device=device),
                 q=torch.randn(2, 4, 128, device=device))
    mixed = KVCacheLayout(2, 128, RowFormat(128, 64), RowFormat(128, 128), page_size=64)
    with pytest.raises(NotImplementedError, match="key and value group sizes must match"):
        call(layout=mixed, state=PagedKV.allocate(mixed, 2, 4, 2, device=device),
             q=torch.randn(2, 4, 128, device=device))
    wide_v = KVCacheLayout(2, 64, RowFormat(64, 64), RowFormat(64, 64, bits=4), sink=16, window=32)
    with pytest.raises(NotImplementedError, match="values are 2-bit"):
        call(layout=wide_v, state=PagedKV.allocate(wide_v, 2, 4, 2, device=device))
    with pytest.raises(ValueError, match=r"state.k_codes: expected shape \[4, 2, 64, 32\], got \[4, 2, 64, 16\]"):
        call(layout=lay.with_key_bits(4))  # a 2-bit pool handed to a 4-bit key layout
