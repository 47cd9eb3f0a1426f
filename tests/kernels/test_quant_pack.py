"""Triton quantize/pack against ``kernels/reference/`` (the decode-step update: test_decode_step.py).

Codes and fp16 params must be ``torch.equal`` to the reference on the same stored-basis rows
(``helpers.assert_quantizes_like_reference``); the fused rotation path is allowed a stated, small fraction of
boundary flips. On the CPU this runs through Triton's interpreter (tests/kernels/conftest.py), on the H200 compiled.
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, RowFormat
from oscar_export.kernels.transform import LayerTransform

from helpers import CLIPS, LEVELS, assert_equal, assert_quantizes_like_reference, quant_rows


def _layout(d: int, gran: str, g: int | None = None, p: int | None = None, h: int = 3) -> KVCacheLayout:
    g = g or d
    p = p or g
    return KVCacheLayout(h, d, RowFormat(d, g, gran), RowFormat(d, g), sink=64, window=256, page_size=p)


@pytest.mark.parametrize("d,g,gran", [(64, 64, "token"), (128, 128, "token"), (128, 64, "token"),
                                      (256, 128, "token"), (64, 64, "channel"), (128, 128, "channel"),
                                      (256, 128, "channel")])
def test_quantize_pages_bit_exact(qp, device, d, g, gran):
    lay = _layout(d, gran, g)
    fmt = lay.key
    assert_quantizes_like_reference(qp, device, quant_rows(3, 3, lay.page_size, d), lay, fmt, CLIPS, LEVELS)


def _mma16(lay: KVCacheLayout) -> KVCacheLayout:
    from dataclasses import replace

    value = replace(lay.value, packing="mma16") if lay.page_size % 32 == 0 else lay.value  # mma16 values: P % 32
    return replace(lay, key=replace(lay.key, packing="mma16"), value=value)


@pytest.mark.parametrize("d,g,p,gran,operand", [
    (64, 64, 64, "token", "key"), (128, 128, 128, "token", "key"), (128, 64, 32, "token", "key"),
    (64, 64, 16, "token", "key"), (64, 64, 64, "channel", "key"), (128, 128, 32, "channel", "key"),
    (64, 64, 64, "token", "value"), (128, 128, 128, "token", "value"), (128, 64, 32, "token", "value"),
])
def test_quantize_pages_mma16_bit_exact(qp, device, d, g, p, gran, operand):
    """mma16 pages (keys tokens-on-M, values dims-on-M) bit-exact with the reference, both granularities."""
    lay = _mma16(_layout(d, gran, g, p=p))
    fmt = lay.key if operand == "key" else lay.value
    assert_quantizes_like_reference(qp, device, quant_rows(3, 3, p, d), lay, fmt, CLIPS, LEVELS, operand)


@pytest.mark.parametrize("gran,operand", [("token", "key"), ("channel", "key"), ("token", "value")])
def test_fused_rotation_mma16_is_the_linear_result_reordered(qp, device, gran, operand):
    """The in-kernel rotation path (the AOT ``_rot`` kernel) writes the same codes in mma16 order as in linear."""
    lin = _layout(64, gran)
    mma = _mma16(lin)
    h, p, d = 3, lin.page_size, 64
    rot = torch.linalg.qr(torch.randn(h, d, d))[0].contiguous().to(device)
    rotation = (rot, (torch.rand(h, d) + 0.5).to(device), (torch.randn(h, d) * 0.1).to(device))
    x = (torch.randn(2, h, p, d) * 2).to(device)
    fl, fm = (lin.key, mma.key) if operand == "key" else (lin.value, mma.value)
    kw = dict(rotation=rotation, fused_rotation=True)
    cl, pl = qp.quantize_pages(x, lin, fl, CLIPS.to(device), LEVELS.to(device), **kw)
    cm, pm = qp.quantize_pages(x, mma, fm, CLIPS.to(device), LEVELS.to(device), operand=operand, **kw)
    assert_equal("params", pm.cpu(), pl.cpu())
    assert_equal("codes", cm.cpu(), ref.pack_page_codes(ref.unpack_codes(cl.cpu(), d), fm, operand))


# ---- 4-bit key pages (RowFormat.bits == 4, layout.with_key_bits(4)) --------------------------------------------


@pytest.mark.parametrize("d,g,p,gran", [(64, 64, 64, "token"), (128, 128, 128, "token"), (128, 64, 32, "token"),
                                        (256, 128, 64, "token"), (64, 64, 64, "channel"), (128, 128, 32, "channel"),
                                        (256, 128, 64, "channel")])
def test_quantize_4bit_key_pages_bit_exact(qp, device, d, g, p, gran):
    """4-bit key pages ``[N, H_kv, P, D / 2]``: codes and params equal to the reference's 16-level rule."""
    lay = _layout(d, gran, g, p=p).with_key_bits(4)
    want_c, _ = assert_quantizes_like_reference(qp, device, quant_rows(2, 3, p, d), lay, lay.key, CLIPS, LEVELS)
    assert tuple(want_c.shape) == lay.key_codes_shape(2)
    assert int(ref.unpack_codes(want_c, g, 4).max()) == 15  # the test reaches the top level


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_4bit_threshold_ties_and_rank_edges_bit_exact(qp, device, gran):
    """The hard groups of the 2-bit test (ties, repeated maxima, all-equal, zero) on 4-bit key pages."""
    h, n = len(HARD_CLIPS), 64
    lay = KVCacheLayout(h, n, RowFormat(n, n, gran), RowFormat(n, n), sink=64, window=256, page_size=n)
    lay = lay.with_key_bits(4)
    x = _hard_groups(n, n, h)
    if gran == "channel":
        x = x.transpose(-1, -2).contiguous()
    levels = LEVELS[torch.arange(h) % 3]  # ignored by 4-bit pages (reference.format_levels)
    assert_quantizes_like_reference(qp, device, x, lay, lay.key, HARD_CLIPS, levels)


def test_4bit_pool_shape_checked(qp, device):
    """A 4-bit key pool must be ``[N, H_kv, P, D / 2]``: a 2-bit-shaped pool is refused before the launch."""
    lay = _layout(64, "token").with_key_bits(4)
    x = torch.randn(2, 3, 64, 64, device=device)
    ids = torch.tensor([0, 1], dtype=torch.int32, device=device)
    codes = torch.zeros(lay.value_codes_shape(4), dtype=torch.uint8, device=device)
    params = torch.zeros(lay.key_params_shape(4), dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"codes: expected shape \[4, 3, 64, 32\], got \[4, 3, 64, 16\]"):
        qp.write_pages(x, ids, codes, params, lay, lay.key, CLIPS.to(device), LEVELS.to(device))


def test_mma16_unsupported_head_dim_raises(qp, device):
    lay = _mma16(KVCacheLayout(1, 32, RowFormat(32, 32), RowFormat(32, 32), page_size=32))
    with pytest.raises(NotImplementedError, match="'mma16' pages for head_dim >= 64, got 32"):
        qp.quantize_pages(torch.randn(1, 1, 32, 32, device=device), lay, lay.key, CLIPS[:1].to(device),
                          LEVELS[:1].to(device))


def _hard_groups(p: int, g: int, h: int) -> torch.Tensor:
    """``[1, h, p, g]``: one quantization group per row, built to break a top-k threshold search."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(h, p, g, generator=gen) * 1.5
    x = torch.round(x * 2) / 2  # a coarse grid: ties everywhere, also across signs (+2 and -2)
    x[:, 0] = 0.5  # all equal
    x[:, 1] = 0.0  # all zero: threshold 0, scale 0
    x[:, 2, :: max(1, g // 10)] = 3.0  # the max repeated ~10 times
    x[:, 3] = torch.linspace(-1, 1, g)
    # ties at the 8th..12th
    x[:, 3, :12] = torch.tensor([5.0, -4.5, 4.0, 3.5, -3.0, 2.5, 2.0, 1.5, -1.5, 1.5, 1.5, -1.5])
    x[:, 4, g // 2:] = -x[:, 4, : g // 2]  # every |x| exactly twice
    x[:, 5] = torch.randn(g, generator=gen) * 1e-3  # distinct, tiny
    x[:, 6, 5] = 1e4  # one huge outlier
    x[:, 7] = torch.arange(g, dtype=torch.float32).flip(0) // 3  # runs of three equal values, descending
    return x[None]


# ranks for a 64-element group: K = 64 - rank values from the top decide the clip. K = 1 (clip 1), 8 and 9
# (the fast path's edge), 16 and 17 (a second round, its edge), 64 (rank 0: the smallest |x|), 6 and 33.
HARD_CLIPS = torch.tensor([1.0, 57 / 64, 56 / 64, 49 / 64, 48 / 64, 0.01, 0.96, 0.5])


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_threshold_ties_and_rank_edges_bit_exact(qp, device, gran):
    """Ties at and around the threshold, repeated maxima, all-equal and zero groups, rank 0 and G - 1."""
    h, n = len(HARD_CLIPS), 64
    lay = KVCacheLayout(h, n, RowFormat(n, n, gran), RowFormat(n, n), sink=64, window=256, page_size=n)
    x = _hard_groups(n, n, h)  # token: a group is a row
    if gran == "channel":
        x = x.transpose(-1, -2).contiguous()  # a group is a channel over the page's tokens
    levels = LEVELS[torch.arange(h) % 3]
    assert_quantizes_like_reference(qp, device, x, lay, lay.key, HARD_CLIPS, levels)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gran", ["token", "channel"])
@pytest.mark.parametrize("bits", [2, 4])
def test_16bit_rows_hard_groups_bit_exact(qp, device, gran, dtype, bits):
    """BF16/FP16 rows (the recent buffer's and the prefill's dtype): the hard groups (ties at the threshold,
    repeated maxima, all-equal and zero groups, rank 0 and G - 1) on 128-token pages (several row blocks of the
    token quantizer), equal to the reference on the same values in fp32."""
    h, n = len(HARD_CLIPS), 64
    lay = KVCacheLayout(h, n, RowFormat(n, n, gran), RowFormat(n, n), sink=64, window=256, page_size=2 * n)
    lay = lay.with_key_bits(4) if bits == 4 else lay
    x = torch.cat([_hard_groups(n, n, h), _hard_groups(n, n, h).flip(-2) * 0.75], dim=-2)  # [1, h, 2n, n]
    if gran == "channel":
        x = torch.cat([x[..., :n, :].transpose(-1, -2), x[..., n:, :].transpose(-1, -2)], dim=-2)
    x = x.to(dtype)
    levels = LEVELS[torch.arange(h) % 3]
    want_c, _ = assert_quantizes_like_reference(qp, device, x, lay, lay.key, HARD_CLIPS, levels)


# levels whose clamped codes are not 0 at -thr and 3 at thr, so the clamp before the code decides codes: lv3 beyond
# the range (3 not reached at thr), lv0 below it (0 not reached at -thr), not ascending
ODD_LEVELS = torch.tensor([[0.0, 1.0, 2.0, 5.0], [-2.0, -1.0, 0.5, 3.0], [0.0, 3.0, 1.0, 2.0]])


@pytest.mark.parametrize("gran,packing,g", [("token", "linear", 64), ("channel", "linear", 64),
                                            ("token", "mma16", 32), ("channel", "mma16", 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamp_at_the_code_thresholds_bit_exact(qp, device, gran, packing, g, dtype):
    """Odd levels on the hard groups (outliers past the clip, zero and constant groups): the codes of clamped
    values equal the reference's, whichever code ``-thr`` and ``thr`` get. Token mma16 with two groups a row
    takes the whole-row code path."""
    h, n = len(HARD_CLIPS), 64
    lay = KVCacheLayout(h, n, RowFormat(n, g, gran), RowFormat(n, g), sink=64, window=256, page_size=n)
    lay = _mma16(lay) if packing == "mma16" else lay
    x = _hard_groups(n, n, h)
    if gran == "channel":
        x = x.transpose(-1, -2).contiguous()
    x = x.to(dtype)
    levels = ODD_LEVELS[torch.arange(h) % 3]
    want_c, _ = assert_quantizes_like_reference(qp, device, x, lay, lay.key, HARD_CLIPS, levels)
    codes = ref.unpack_page_codes(want_c, lay.key, "key")
    assert int(codes.min()) == 0 and int(codes.max()) == 3  # not degenerate: the odd levels still use codes 0..3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gran", ["token", "channel"])
@pytest.mark.parametrize("warps", [1, 2, 4, 8])
def test_quantize_real_shape_every_width_bit_exact(qp, device, gran, warps):
    """8 KV heads, D = P = G = 128, BF16 rows (ties), clips from 1.0 to 0.5: every launch width exact."""
    lay = KVCacheLayout.default(8, 128, gran)
    x = (torch.randn(64, 8, 128, 128, device=device) * torch.linspace(0.1, 3, 128, device=device)).bfloat16()
    clip = torch.tensor([1.0, 0.99, 0.96, 0.94, 0.92, 0.87, 0.75, 0.5], device=device)
    levels = LEVELS[torch.arange(8) % 3].to(device)
    assert_quantizes_like_reference(qp, device, x, lay, lay.key, clip, levels, num_warps=warps)


def test_quantize_bf16_input_bit_exact(qp, device):
    lay = _layout(64, "token")
    assert_quantizes_like_reference(qp, device, quant_rows(2, 3, 64, 64).bfloat16(), lay, lay.value, CLIPS, LEVELS)


def test_write_pages_into_pool_at_page_ids(qp, device):
    lay = _layout(64, "channel")
    x = quant_rows(2, 3, 64, 64)
    codes = torch.full(lay.codes_shape(5), 0xAB, dtype=torch.uint8, device=device)
    params = torch.full(lay.key_params_shape(5), -7.0, dtype=torch.float16, device=device)
    ids = torch.tensor([4, 1], dtype=torch.int32, device=device)
    qp.write_pages(x.to(device), ids, codes, params, lay, lay.key, CLIPS.to(device), LEVELS.to(device))
    want_c, want_p = ref.quantize_pages(x, lay.key, CLIPS, LEVELS)
    assert_equal("codes page 4", codes[4].cpu(), want_c[0])
    assert_equal("codes page 1", codes[1].cpu(), want_c[1])
    assert_equal("params page 1", params[1].cpu(), want_p[1])
    for untouched in (0, 2, 3):  # pages not named are left alone
        assert bool((codes[untouched] == 0xAB).all()) and bool((params[untouched] == -7.0).all())


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("gran,d,g,bits", [("token", 64, 64, 2), ("channel", 64, 64, 2), ("token", 256, 128, 2),
                                           ("token", 64, 64, 4), ("channel", 64, 64, 4)])
def test_fused_rotation_within_tolerance(qp, device, gran, fused, d, g, bits):
    """(x @ R) * d - mu, rounded to BF16, then quantized: only exact-boundary flips may differ.

    ``fused``: the product inside the kernel (the AOT ``_rot`` kernel; at D = 256 R is read ROT_K rows at a
    time), else ``torch.matmul`` before it. ``bits``: the key pages' code width.
    """
    lay = _layout(d, gran, g, p=64 if d > 128 else None).with_key_bits(bits)
    h, p = 3, lay.page_size
    rot = torch.linalg.qr(torch.randn(h, d, d))[0].contiguous()
    tr = LayerTransform(
        k_rotation=rot, v_rotation=rot.clone(), k_scale=torch.rand(h, d) + 0.5, v_scale=torch.ones(h, d),
        k_mean=torch.randn(h, d) * 0.1, v_mean=torch.zeros(h, d), k_clip=CLIPS, v_clip=CLIPS,
        k_levels=LEVELS, v_levels=LEVELS,
    )
    x = torch.randn(4, h, p, d) * 2  # model basis (post-RoPE keys), one page per leading index
    stored = tr.transform_keys(x).bfloat16().float()  # what append_tokens would quantize
    want_c, want_p = ref.quantize_pages(stored, lay.key, CLIPS, LEVELS)
    got_c, got_p = qp.quantize_pages(
        x.to(device), lay, lay.key, CLIPS.to(device), LEVELS.to(device),
        rotation=(tr.k_rotation.to(device), tr.k_scale.to(device), tr.k_mean.to(device)), fused_rotation=fused,
    )
    got_c, got_p = got_c.cpu(), got_p.cpu()
    deq_want = ref.dequantize_pages(want_c, want_p, lay.key, LEVELS)
    deq_got = ref.dequantize_pages(got_c, got_p, lay.key, LEVELS)
    code_flips = (ref.unpack_codes(got_c, g, bits) != ref.unpack_codes(want_c, g, bits)).float().mean().item()
    rel = ((deq_got - deq_want).norm() / deq_want.norm()).item()
    # a flip needs an fp32 summation-order difference to cross a BF16 rounding or code boundary: rare
    assert code_flips <= 2e-3, f"fused rotation flipped {code_flips:.2%} of codes"
    assert rel <= 5e-3, f"fused rotation: relative dequantized difference {rel:.3e}"


# ---- bad input: raised before any launch ---------------------------------------------------------------------


def _good(device):
    lay = _layout(64, "token")
    x = torch.randn(2, 3, 64, 64, device=device)
    return lay, x, CLIPS.to(device), LEVELS.to(device)


def test_bad_inputs_raise(qp, device):
    lay, x, clip, lev = _good(device)
    with pytest.raises(ValueError, match="x: expected float32"):
        qp.quantize_pages(x.to(torch.int32), lay, lay.key, clip, lev)
    with pytest.raises(ValueError, match=r"x: expected \[N, 3, 64, 64\]"):
        qp.quantize_pages(x[:, :2], lay, lay.key, clip, lev)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        qp.quantize_pages(x.transpose(-1, -2), lay, lay.key, clip, lev)
    with pytest.raises(ValueError, match="clip: expected shape"):
        qp.quantize_pages(x, lay, lay.key, clip[:2], lev)
    with pytest.raises(ValueError, match="levels: expected dtype"):
        qp.quantize_pages(x, lay, lay.key, clip, lev.double())
    with pytest.raises(ValueError, match="device"):
        qp.quantize_pages(x, lay, lay.key, clip.to("meta"), lev)
    with pytest.raises(ValueError, match="round_dtype"):
        qp.quantize_pages(x, lay, lay.key, clip, lev, rotation=(torch.eye(64, device=device).repeat(3, 1, 1),
                          torch.ones(3, 64, device=device), torch.zeros(3, 64, device=device)),
                          round_dtype=torch.float64)
    with pytest.raises(ValueError, match="rotation: expected shape"):
        qp.quantize_pages(x, lay, lay.key, clip, lev, rotation=(torch.eye(64, device=device),
                          torch.ones(3, 64, device=device), torch.zeros(3, 64, device=device)))
    codes = torch.zeros(lay.key_codes_shape(4), dtype=torch.uint8, device=device)
    params = torch.zeros(lay.key_params_shape(4), dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="page_ids: expected dtype torch.int32"):
        qp.write_pages(x, torch.tensor([0, 1], device=device), codes, params, lay, lay.key, clip, lev)
    with pytest.raises(ValueError, match="params: expected dtype torch.float16"):
        qp.write_pages(x, torch.tensor([0, 1], dtype=torch.int32, device=device), codes, params.float(), lay,
                       lay.key, clip, lev)
    odd = KVCacheLayout(3, 96, RowFormat(96, 96), RowFormat(96, 96), page_size=32)
    with pytest.raises(NotImplementedError, match="power-of-two"):
        qp.quantize_pages(torch.randn(1, 3, 32, 96, device=device), odd, odd.key, clip, lev)
