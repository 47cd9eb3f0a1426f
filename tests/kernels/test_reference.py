"""The PyTorch reference (kernels/reference/): exact where math allows. The layout itself: test_layout.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, PagedKV, RowFormat
from oscar_export.kernels.transform import LayerTransform

from helpers import BOUNDARY_LENGTHS, GQA_SHAPES, HEAD_DIMS


def filled_state(layout: KVCacheLayout, lengths: list[int], tr: LayerTransform, dtype=torch.float32, one_by_one=False):
    """A state holding ``lengths[b]`` random stored-basis tokens per sequence; returns (state, k, v)."""
    b = len(lengths)
    pages = max(1, max(layout.pages_for(n) for n in lengths))
    state = PagedKV.allocate(layout, b, b * pages, pages, dtype=dtype)
    free = iter(range(b * pages))
    h, d = layout.num_kv_heads, layout.head_dim
    k = torch.randn(b, h, max(lengths), d)
    v = torch.randn(b, h, max(lengths), d)
    for i, n in enumerate(lengths):
        if one_by_one:
            for t in range(n):
                ref.append_tokens(state, i, k[i, :, t : t + 1], v[i, :, t : t + 1], layout, tr, lambda: next(free))
        elif n:
            ref.append_tokens(state, i, k[i, :, :n], v[i, :, :n], layout, tr, lambda: next(free))
    return state, k, v


def worst(a: torch.Tensor, b: torch.Tensor, n: int = 5) -> str:
    diff = (a.double() - b.double()).abs().flatten()
    top = diff.topk(min(n, diff.numel()))
    return f"worst |diff| {top.values.tolist()} at flat indices {top.indices.tolist()}"


# ---- packing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d, g", [(16, 16), (64, 64), (128, 128), (256, 128), (64, 32)])
def test_pack_unpack_round_trip(d, g):
    codes = torch.randint(0, 4, (3, 5, d), dtype=torch.uint8)
    packed = ref.pack_codes(codes, g)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, d // 4)
    assert torch.equal(ref.unpack_codes(packed, g), codes)


def test_golden_byte_pins_the_bit_order():
    """G = 16: byte b holds elements b, b+4, b+8, b+12 at bits 0, 2, 4, 6."""
    codes = torch.zeros(16, dtype=torch.uint8)
    codes[0], codes[4], codes[8], codes[12] = 1, 2, 3, 0
    codes[3], codes[7], codes[11], codes[15] = 3, 3, 0, 1
    packed = ref.pack_codes(codes, 16)
    assert packed.tolist() == [0b00_11_10_01, 0, 0, 0b01_00_11_11]  # 57, 0, 0, 79
    two_groups = ref.pack_codes(torch.cat([codes, codes.flip(0)]), 16)
    assert two_groups.tolist() == [57, 0, 0, 79, 0b11_11_00_01, 0, 0, 0b01_10_11_00]


# ---- the mma16 packing ----------------------------------------------------------------------------------------


def mma16_byte_and_bit(r: int, c: int, rows: int, cols: int) -> tuple[int, int]:
    """Byte index and bit of code (r, c) under mma16, straight from ``pack_mma16``'s docstring formula."""
    mb = ref.mma16_group(rows, cols)
    blk, rr = divmod(r, 16)
    mo, mi = divmod(blk, mb)
    hr, g = divmod(rr, 8)
    w, cc = divmod(c, 32)
    kb, cc = divmod(cc, 16)
    hc, cc = divmod(cc, 8)
    tq, e = divmod(cc, 2)
    lane = 4 * g + tq
    byte = (((mo * 32 + lane) * mb + mi) * (cols // 32) + w) * 4 + 2 * e + kb
    return byte, 2 * (2 * hc + hr)


def test_mma16_golden_bytes_worked_example():
    """R = 16, C = 32 (128 bytes): the worked example of ``pack_mma16``'s docstring, code by code."""
    cases = {(0, 0): (0, 0), (8, 0): (0, 2), (0, 8): (0, 4), (8, 8): (0, 6), (0, 1): (2, 0), (0, 16): (1, 0),
             (0, 17): (3, 0), (0, 2): (4, 0), (1, 0): (16, 0), (15, 31): (127, 6)}
    for (r, c), (byte, bit) in cases.items():
        codes = torch.zeros(16, 32, dtype=torch.uint8)
        codes[r, c] = 3
        packed = ref.pack_mma16(codes)
        want = torch.zeros(128, dtype=torch.uint8)
        want[byte] = 3 << bit
        assert torch.equal(packed, want), ((r, c), packed.nonzero().tolist())
        assert mma16_byte_and_bit(r, c, 16, 32) == (byte, bit)
    # four codes of byte 0: rows 0/8 x columns 0/8 at bits 0, 2, 4, 6
    codes = torch.zeros(16, 32, dtype=torch.uint8)
    codes[0, 0], codes[8, 0], codes[0, 8], codes[8, 8] = 1, 2, 3, 0
    assert ref.pack_mma16(codes)[0].item() == 0b00_11_10_01


@pytest.mark.parametrize("rows, cols", [(16, 32), (32, 64), (64, 128), (128, 64), (48, 64), (16, 256), (64, 32)])
def test_mma16_matches_the_formula_and_round_trips(rows, cols):
    torch.manual_seed(rows + cols)
    codes = torch.randint(0, 4, (2, rows, cols), dtype=torch.uint8)
    packed = ref.pack_mma16(codes)
    assert packed.shape == (2, rows * cols // 4)
    assert torch.equal(ref.unpack_mma16(packed, rows, cols), codes)
    want = torch.zeros(2, rows * cols // 4, dtype=torch.int32)
    for r in range(rows):
        for c in range(cols):
            byte, bit = mma16_byte_and_bit(r, c, rows, cols)
            want[:, byte] |= codes[:, r, c].to(torch.int32) << bit
    assert torch.equal(packed.to(torch.int32), want)


@pytest.mark.parametrize("operand", ["key", "value"])
def test_page_codes_convert_between_packings_into_contiguous_pools(operand):
    """mma16 -> codes -> linear gives a contiguous pool the kernels accept (the value unpack's transposed view is
    not carried into the linear pack)."""
    lin = RowFormat(head_dim=128, group_size=128, granularity="token")
    mma = RowFormat(head_dim=128, group_size=128, granularity="token", packing="mma16")
    codes = torch.randint(0, 4, (3, 2, 64, 128), dtype=torch.uint8)
    back = ref.unpack_page_codes(ref.pack_page_codes(codes, mma, operand), mma, operand)
    assert torch.equal(back, codes) and back.is_contiguous()
    assert ref.pack_page_codes(back, lin, operand).is_contiguous()


@pytest.mark.parametrize("rows, cols", [(64, 128), (32, 64), (128, 64)])
def test_mma16_lane_load_is_the_m16n8k16_a_fragment(rows, cols):
    """One lane's contiguous bytes, read as words, are its A-fragment registers: for word ``w`` of row block
    ``blk`` and field ``k = 4kb + 2hc + hr``, ``(word >> 2k) & 0x00030003`` holds codes (g + 8hr, 2tq + 8hc)
    and (.., +1) of the 16x16 tile (blk, 2w + kb): the PTX ISA's m16n8k16 fp16 A layout, a_i for i = hr + 2hc."""
    torch.manual_seed(0)
    codes = torch.randint(0, 4, (rows, cols), dtype=torch.uint8)
    words = ref.pack_mma16(codes).view(torch.int32)  # little-endian words
    mb = ref.mma16_group(rows, cols)
    run = mb * cols // 32  # words per lane run
    assert run * 4 == 16 or (mb == 1 and cols < 128)  # the 16-byte load per thread
    for mo in range(rows // (16 * mb)):
        for lane in range(32):
            g, tq = divmod(lane, 4)
            mine = words[(mo * 32 + lane) * run : (mo * 32 + lane + 1) * run]
            for i, word in enumerate(mine.tolist()):
                mi, w = divmod(i, cols // 32)
                blk = mo * mb + mi
                for kb in range(2):
                    for reg in range(4):  # a0..a3
                        hr, hc = reg % 2, reg // 2
                        k = 4 * kb + 2 * hc + hr
                        pair = (word >> (2 * k)) & 0x00030003
                        row = 16 * blk + g + 8 * hr
                        col = 16 * (2 * w + kb) + 2 * tq + 8 * hc
                        assert (pair & 0xFFFF, pair >> 16) == (codes[row, col].item(), codes[row, col + 1].item())


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_quantize_pages_mma16_is_a_reordering_of_linear(granularity):
    """Same codes and params as linear, only reordered; keys as [P, D], values as the transposed [D, P]."""
    lin = KVCacheLayout.default(2, 64, granularity)
    mma = KVCacheLayout.default(2, 64, granularity, packing="mma16")
    x = torch.randn(3, 2, 64, 64)
    clip, lev = torch.tensor([0.95, 1.0]), torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(2, 4)
    for operand, fl, fm in (("key", lin.key, mma.key), ("value", lin.value, mma.value)):
        if operand == "value" and granularity == "channel":
            continue
        cl, pl = ref.quantize_pages(x, fl, clip, lev)
        cm, pm = ref.quantize_pages(x, fm, clip, lev, operand)
        assert torch.equal(pl, pm)
        codes = ref.unpack_codes(cl, 64)  # [N, H, P, D]
        mat = codes if operand == "key" else codes.transpose(-1, -2)
        assert torch.equal(cm.flatten(-2), ref.pack_mma16(mat)), operand
        assert torch.equal(ref.dequantize_pages(cm, pm, fm, lev, operand), ref.dequantize_pages(cl, pl, fl, lev))
        if operand == "value":  # the other operand's order is a different (wrong) page
            assert not torch.equal(ref.dequantize_pages(cm, pm, fm, lev, "key"), ref.dequantize_pages(cl, pl, fl, lev))


def test_mma16_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="R % 16 == 0 and C % 32 == 0"):
        ref.pack_mma16(torch.zeros(16, 48, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot hold"):
        ref.unpack_mma16(torch.zeros(100, dtype=torch.uint8), 16, 32)
    with pytest.raises(ValueError, match="operand: expected 'key' or 'value'"):
        ref.pack_page_codes(torch.zeros(64, 64, dtype=torch.uint8), RowFormat(64, 64, packing="mma16"), "k")


# ---- quantizer and params -----------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_quantize_pages_params_are_fp16_with_layout_shapes(granularity):
    lay = KVCacheLayout.default(3, 64, granularity)
    x = torch.randn(2, 3, lay.page_size, 64)
    codes, params = ref.quantize_pages(x, lay.key, torch.ones(3), torch.tensor([0.0, 1, 2, 3]).expand(3, 4))
    assert codes.dtype == torch.uint8 and codes.shape == lay.codes_shape(2)
    assert params.dtype == torch.float16 and params.shape == lay.key_params_shape(2)


def test_quantize_groups_follows_the_documented_rule():
    """Min-max without clipping: the min and max of each group come back exactly as fp16-rounded values."""
    x = torch.randn(50, 64)
    lv = torch.tensor([0.0, 1, 2, 3])
    codes, scale, lo = ref.quantize_groups(x, torch.tensor([[63]]), lv)
    assert torch.equal(lo, x.min(-1).values.half())
    assert torch.equal(scale, ((x.max(-1).values - x.min(-1).values) * 0.3333333432674408).half())
    back = ref.dequantize_groups(codes, scale, lo, lv)
    assert bool(((back - x).abs() <= scale.float()[:, None] * 0.5 + 5e-3).all()), worst(back, x)


def test_nan_keys_are_rejected():
    lay = KVCacheLayout.default(2, 64)
    state = PagedKV.allocate(lay, 1, 4, 4, dtype=torch.float32)
    k = torch.randn(2, 500, 64)
    k[1, 400, 5] = float("nan")
    with pytest.raises(ValueError, match="keys: 1 non-finite values"):
        ref.append_tokens(state, 0, k, k.abs(), lay, LayerTransform.identity(2, 64), iter(range(4)).__next__)
    assert int(state.sink_len[0]) == 0


# ---- writers: prefill == token by token -------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_prefill_and_token_by_token_leave_identical_caches(granularity):
    lay = KVCacheLayout.default(2, 64, granularity)
    tr = LayerTransform.identity(2, 64, 0.95, 0.9)
    lengths = [n for n in BOUNDARY_LENGTHS if n <= 511]
    torch.manual_seed(1)
    a, k, v = filled_state(lay, lengths, tr)
    torch.manual_seed(1)
    b, k2, _ = filled_state(lay, lengths, tr, one_by_one=True)
    assert torch.equal(k, k2)
    for name in ("sink_len", "num_pages", "recent_len"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    ka, va, valid = ref.gather_context(a, lay, tr.k_levels, tr.v_levels)
    kb, vb, valid_b = ref.gather_context(b, lay, tr.k_levels, tr.v_levels)
    assert torch.equal(valid, valid_b)
    for i, n in enumerate(lengths):
        assert int(valid[i].sum()) == n
        assert torch.equal(ka[i][:, valid[i]], kb[i][:, valid[i]]), worst(ka[i][:, valid[i]], kb[i][:, valid[i]])
        assert torch.equal(va[i][:, valid[i]], vb[i][:, valid[i]])
        s0, pages, _ = lay.split(n)
        # in token order, windows hold the tokens exactly; pages hold their quantized form
        kt, vt = ref.read_sequence(a, lay, i, tr.k_levels, tr.v_levels)
        assert kt.shape[1] == n
        assert torch.equal(kt[:, :s0], k[i, :, :s0])
        assert torch.equal(kt[:, s0 + pages * 64 :], k[i, :, s0 + pages * 64 : n])
        assert torch.equal(vt[:, s0 + pages * 64 :], v[i, :, s0 + pages * 64 : n])


# ---- attention ------------------------------------------------------------------------------------------------


def oracle_decode(q, state, layout, tr, scale):
    """fp64 attention over each sequence's valid slots, gathered independently of masked_attention."""
    k, v, valid = ref.gather_context(state, layout, tr.k_levels, tr.v_levels)
    out = []
    for i in range(q.shape[0]):
        kk = k[i][:, valid[i]].double().repeat_interleave(q.shape[1] // k.shape[1], 0)
        vv = v[i][:, valid[i]].double().repeat_interleave(q.shape[1] // k.shape[1], 0)
        p = torch.softmax(torch.einsum("hd,htd->ht", q[i].double(), kk) * scale, -1)
        out.append(torch.einsum("ht,htd->hd", p, vv))
    return torch.stack(out).float()


@pytest.mark.parametrize("h, h_kv", GQA_SHAPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_attention_over_boundary_lengths(h, h_kv, d):
    """A ragged batch of every boundary length: fp32 reference vs fp64 oracle on the same stored cache."""
    lay = KVCacheLayout.default(h_kv, d)
    tr = LayerTransform.identity(h_kv, d)
    state, _, _ = filled_state(lay, BOUNDARY_LENGTHS, tr)
    q = torch.randn(len(BOUNDARY_LENGTHS), h, d)
    got = ref.decode_attention(q, state, lay, tr.k_levels, tr.v_levels, d**-0.5)
    want = oracle_decode(q, state, lay, tr, d**-0.5)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), worst(got, want)


@pytest.mark.parametrize("h, h_kv", GQA_SHAPES[:3])
def test_decode_within_windows_equals_sdpa(h, h_kv):
    """No INT2 pages (length <= S0 + W): decode attention is plain attention over the tokens."""
    lay = KVCacheLayout.default(h_kv, 64)
    tr = LayerTransform.identity(h_kv, 64)
    lengths = [1, 63, 64, 65, 320]
    state, k, v = filled_state(lay, lengths, tr)
    q = torch.randn(len(lengths), h, 64)
    got = ref.decode_attention(q, state, lay, tr.k_levels, tr.v_levels, 0.125)
    for i, n in enumerate(lengths):
        kk = k[i : i + 1, :, :n].repeat_interleave(h // h_kv, 1)
        vv = v[i : i + 1, :, :n].repeat_interleave(h // h_kv, 1)
        want = F.scaled_dot_product_attention(q[i : i + 1, :, None], kk, vv, scale=0.125)[:, :, 0]
        assert torch.allclose(got[i : i + 1], want, atol=1e-5, rtol=1e-5), f"length {n}: {worst(got[i:i+1], want)}"


def test_chunk_attention_is_causal_over_stored_history():
    lay = KVCacheLayout.default(3, 64)
    tr = LayerTransform.identity(3, 64)
    state, _, _ = filled_state(lay, [449, 100], tr)
    q, kn, vn = torch.randn(2, 9, 7, 64), torch.randn(2, 3, 7, 64), torch.randn(2, 3, 7, 64)
    got = ref.chunk_attention(q, kn, vn, state, lay, tr.k_levels, tr.v_levels, 0.125)
    k, v, valid = ref.gather_context(state, lay, tr.k_levels, tr.v_levels)
    for t in range(7):  # query t == decode over (stored history + new tokens 0..t at full precision)
        for i in range(2):
            kk = torch.cat([k[i][:, valid[i]], kn[i, :, : t + 1]], 1).repeat_interleave(3, 0)
            vv = torch.cat([v[i][:, valid[i]], vn[i, :, : t + 1]], 1).repeat_interleave(3, 0)
            want = F.scaled_dot_product_attention(q[i, :, t : t + 1], kk, vv, scale=0.125)[:, 0]
            assert torch.allclose(got[i, :, t], want, atol=1e-5, rtol=1e-5), worst(got[i, :, t], want)


@pytest.mark.slow
@pytest.mark.representative
def test_compiled_decode_attention_equals_eager():
    """torch.compile(fullgraph=True) of the reference decode attention: same numbers as eager."""
    lay = KVCacheLayout.default(3, 64, "channel")
    tr = LayerTransform.identity(3, 64)
    state, _, _ = filled_state(lay, [1, 65, 449, 777], tr)
    q = torch.randn(4, 9, 64)
    eager = ref.decode_attention(q, state, lay, tr.k_levels, tr.v_levels, 0.125)
    compiled = torch.compile(ref.decode_attention, fullgraph=True)
    got = compiled(q, state, lay, tr.k_levels, tr.v_levels, 0.125)
    assert torch.allclose(got, eager, atol=1e-6, rtol=1e-5), worst(got, eager)


# ---- 4-bit key pages (RowFormat.bits == 4) ------------------------------------------------------------------------


def test_four_bit_codes_golden_bytes_and_round_trip():
    """Byte b of a packing group holds elements b and b + G/2 at bits 0 and 4."""
    codes = torch.zeros(1, 16, dtype=torch.uint8)
    codes[0, 0], codes[0, 8], codes[0, 1], codes[0, 15] = 0x3, 0xA, 0xF, 0x5
    packed = ref.pack_codes(codes, 16, bits=4)
    assert packed.shape == (1, 8)
    assert packed[0, 0].item() == 0xA3 and packed[0, 1].item() == 0x0F and packed[0, 7].item() == 0x50
    for d, g in ((64, 64), (128, 128), (256, 128)):
        c = torch.randint(0, 16, (3, 5, d), dtype=torch.uint8)
        assert torch.equal(ref.unpack_codes(ref.pack_codes(c, g, 4), g, 4), c)


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_four_bit_pages_are_the_16_level_rule(gran):
    """quantize/dequantize_pages of a 4-bit format = the b-bit group rule with uniform levels 0..15 (what the
    evaluation's 4-bit lever measured), and strictly closer to the input than the 2-bit pages."""
    from oscar_export.kernels.reference import dequantize_groups, quantize_groups
    from oscar_export.kernels.transform import clip_rank

    torch.manual_seed(3)
    lay2 = KVCacheLayout.default(2, 64, gran)
    lay4 = lay2.with_key_bits(4)
    x = torch.randn(3, 2, 64, 64)
    ones, lv2 = torch.ones(2), torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(2, 4)
    codes, params = ref.quantize_pages(x, lay4.key, ones, lv2)
    assert codes.shape == (3, 2, 64, 32)
    got = ref.dequantize_pages(codes, params, lay4.key, lv2)
    lv = torch.arange(16.0)
    grouped = x if gran == "token" else x.transpose(-1, -2)
    want = dequantize_groups(*quantize_groups(grouped, clip_rank(ones, 64).view(1, 2, 1, 1), lv), lv)
    want = want if gran == "token" else want.transpose(-1, -2)
    assert torch.equal(got, want)
    two = ref.dequantize_pages(*ref.quantize_pages(x, lay2.key, ones, lv2), lay2.key, lv2)
    assert (got - x).square().sum() < 0.2 * (two - x).square().sum()


# ---- the decode step in eager host code (the CPU path) --------------------------------------------------------------


@pytest.mark.parametrize("gran, key_bits, dtype", [("token", 2, torch.float32), ("channel", 4, torch.bfloat16)])
def test_host_decode_step_equals_the_branch_free_reference(gran, key_bits, dtype):
    """``decode_append(skip_idle=True)`` (:func:`decode_append_host`) and ``decode_attention(memo=...)``
    (:func:`gather_context_memo`), what the torch backend runs eagerly on the CPU, leave the same bytes, the same
    dense context and the same attention outputs as the branch-free reference, step by step: ragged slots demoting
    pages at different steps, one slot refused (NaN) for 7 steps, one slot reset and refilled over its old pages."""
    from oscar_export.kernels.pages import PageBook

    lay = KVCacheLayout(2, 64, RowFormat(64, 64, gran, bits=key_bits), RowFormat(64, 64), sink=16, window=16,
                        page_size=16)
    tr = LayerTransform.identity(2, 64, k_clip=0.9, v_clip=0.95)
    books = [PageBook(lay, 3, 200, "cpu") for _ in range(2)]
    states = [PagedKV.allocate(lay, 3, b.num_pool_pages, b.max_pages, dtype=dtype) for b in books]
    memo: dict = {}
    g = torch.Generator().manual_seed(3)
    for step in range(140):  # > S0 + W + 4P: several demotions per slot
        k, v, q = (torch.randn(3, h, 64, generator=g) for h in (2, 2, 4))
        if 5 <= step < 12:
            k[1, 0, 0] = float("nan")  # slot 1 commits nothing for 7 steps: the slots demote at different steps
        if step == 80:
            for book in books:
                book.reset(2)  # slot 2 starts again: its next pages overwrite the ones it held
        outs = []
        for host, book, st in zip((False, True), books, states):
            book.begin(1)
            ref.decode_append(book.state_view(st, book.committed), k, v, book.status, lay, tr, skip_idle=host)
            book.commit(1)
            view = book.state_view(st, book.committed)
            outs.append((ref.gather_context(view, lay, tr.k_levels, tr.v_levels, memo if host else None),
                         ref.decode_attention(q, view, lay, tr.k_levels, tr.v_levels, 0.125, memo if host else None)))
        for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
            assert torch.equal(getattr(states[0], f), getattr(states[1], f)), f"step {step}: {f}"
        (want, got) = outs[0][0], outs[1][0]
        for name, a, b in zip(("K", "V", "mask"), want, got):
            assert torch.equal(a, b), f"step {step}: the memo's dense {name} differs"
        assert torch.equal(outs[0][1], outs[1][1]), f"step {step}: {worst(outs[0][1], outs[1][1])}"
    assert books[1].seq_len.tolist() == [140, 133, 60]
    assert books[1].committed.num_pages.tolist() == [6, 6, 1]  # slot 2 held 2 pages at the reset


def test_clip_threshold_is_the_sorted_element_at_the_rank():
    """The CPU's topk form of the clip threshold picks the same element as the sort (ties, per-head ranks, NaN)."""
    g = torch.Generator().manual_seed(5)
    for shape, ranks in (((7, 3, 64), (63, 61, 50)), ((2, 3, 16, 32), (31, 0, 29)), ((5, 4, 8), (7, 7, 7, 7))):
        a = torch.randn(*shape, generator=g).abs()
        a[..., ::3] = a[..., :1]  # ties
        a.view(-1)[7] = float("nan")
        rank = torch.tensor(ranks).view(1, len(ranks), *([1] * (len(shape) - 2)))  # one rank per head (axis 1)
        want = torch.gather(a.sort(dim=-1).values, -1, rank.expand(*a.shape[:-1], 1))
        got = ref.clip_threshold(a, rank)
        assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), worst(got, want)


# ---- 4-bit key codes in the mma16 order (``pack_mma16(..., bits=4)``; its Triton writers: test_mma16.py) ------


def test_4bit_worked_example():
    """R = C = 16 (128 bytes), the docstring's bytes code by code."""
    for (r, c), (byte, value) in {(0, 0): (0, 0x0F), (8, 0): (0, 0xF0), (0, 8): (1, 0x0F), (0, 1): (2, 0x0F),
                                  (0, 2): (4, 0x0F), (1, 0): (16, 0x0F)}.items():
        codes = torch.zeros(16, 16, dtype=torch.uint8)
        codes[r, c] = 15
        packed = ref.pack_mma16(codes, 4)
        assert packed.shape == (128,) and packed.nonzero().flatten().tolist() == [byte], (r, c)
        assert int(packed[byte]) == value, (r, c)


@pytest.mark.parametrize("rows,cols", [(16, 16), (64, 64), (128, 128), (64, 256), (32, 16), (16, 48)])
def test_4bit_round_trip_and_word_rule(rows, cols):
    """Round trip, and every code where the word rule says: word ``((mo 32 + lane) MB + mi) (C / 16) + w``,
    bits ``4 (2 hc + hr) + 16 e``."""
    torch.manual_seed(rows * cols)
    codes = torch.randint(0, 16, (2, rows, cols), dtype=torch.uint8)
    packed = ref.pack_mma16(codes, 4)
    assert packed.shape == (2, rows * cols // 2)
    assert torch.equal(ref.unpack_mma16(packed, rows, cols, 4), codes)
    words = packed[1].view(torch.int32).long() & 0xFFFFFFFF
    mb = ref.mma16_group(rows, cols, 4)
    r = torch.arange(rows)[:, None].expand(rows, cols)
    c = torch.arange(cols)[None, :].expand(rows, cols)
    blk, hr, g = r // 16, (r // 8) % 2, r % 8
    w, hc, tq, e = c // 16, (c // 8) % 2, (c // 2) % 4, c % 2
    word = (((blk // mb) * 32 + 4 * g + tq) * mb + blk % mb) * (cols // 16) + w
    got = (words[word] >> (4 * (2 * hc + hr) + 16 * e)) & 15
    assert torch.equal(got, codes[1].long())


def test_page_codes_round_trip_and_refusals():
    fmt = RowFormat(128, 128, bits=4, packing="mma16")
    codes = torch.randint(0, 16, (3, 2, 64, 128), dtype=torch.uint8)
    packed = ref.pack_page_codes(codes, fmt, "key")
    assert packed.shape == (3, 2, 64, 64)
    assert torch.equal(ref.unpack_page_codes(packed, fmt, "key"), codes)
    assert ref.mma16_group(64, 32, 4) == 2 and ref.mma16_group(64, 64, 4) == 1 and ref.mma16_group(64, 32) == 4
    with pytest.raises(ValueError, match="4-bit codes need"):
        ref.pack_mma16(torch.zeros(16, 24, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="cannot hold"):
        ref.unpack_mma16(torch.zeros(100, dtype=torch.uint8), 16, 16, 4)
    with pytest.raises(ValueError, match="bits 2 or 4"):
        ref.pack_mma16(torch.zeros(16, 32, dtype=torch.uint8), 3)
