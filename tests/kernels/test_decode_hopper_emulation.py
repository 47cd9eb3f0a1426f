"""The hopper decode kernel's arithmetic on the CPU (``kernels/decode/hopper_emulation.py``; Gluon has no interpreter):

* its A operands: ``emulate_a_operand`` (the kernel's loads, field masks, joins, permute and reshape, step by
  step in PyTorch) equals the mma16 codes times the powers of two the kernel folds out;
* its arithmetic: ``emulate`` (those operands, the kernel's scale folding and fp16 roundings) is within the
  decode-attention error budget (``helpers.check_attention_budget``) against the fp64 oracle.

The kernel itself: test_decode_hopper_kernel.py (its sm_90 compilation) and, on the H200,
tests/gpu/test_kernels_gpu.py -k gluon (against this emulation too).
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import checks
from oscar_export.kernels import reference as ref
from oscar_export.kernels.decode import hopper_emulation as gl_attn
from oscar_export.kernels.layout import KVCacheLayout, RowFormat
from oscar_export.kernels.transform import LayerTransform

from helpers import check_attention_budget, ragged_cache


def _mma(h_kv: int, d: int, gran: str, codebook: bool = False, **kw) -> KVCacheLayout:
    return KVCacheLayout(h_kv, d, RowFormat(d, d, gran, codebook=codebook, packing="mma16"),
                         RowFormat(d, d, codebook=codebook, packing="mma16"), **kw)


@pytest.mark.parametrize("rows,cols", [(128, 128), (64, 128), (128, 64), (64, 64), (256, 128), (128, 256)])
def test_a_operand_is_the_codes_times_the_folded_powers(rows, cols):
    torch.manual_seed(rows + cols)
    codes = torch.randint(0, 4, (rows, cols), dtype=torch.uint8)
    page = ref.pack_mma16(codes)
    want = (codes.double() * (4.0 ** (2 * ((torch.arange(cols) // 8) % 2)))[None, :]
            * (4.0 ** ((torch.arange(rows) // 8) % 2))[:, None] * 2.0 ** -24)
    got = gl_attn.emulate_a_operand(page, rows, cols)
    assert got.dtype == torch.float16
    assert torch.equal(got.double(), want)
    if cols > 128:  # the kernel's 128-column chunks of wide key rows
        for c0 in range(0, cols, 128):
            assert torch.equal(gl_attn.emulate_a_operand(page, rows, cols, c0, 128).double(), want[:, c0:c0 + 128])


@pytest.mark.parametrize("rows,cols", [(128, 128), (64, 64), (128, 256), (64, 128)])
def test_4bit_a_operand_is_the_codes_times_the_folded_powers(rows, cols):
    """4-bit key pages: the operand is ``code·16^hr·2^-24`` (nothing on the columns)."""
    torch.manual_seed(rows + cols + 4)
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    page = ref.pack_mma16(codes, 4)
    want = codes.double() * (16.0 ** ((torch.arange(rows) // 8) % 2))[:, None] * 2.0 ** -24
    got = gl_attn.emulate_a_operand(page, rows, cols, bits=4)
    assert got.dtype == torch.float16
    assert torch.equal(got.double(), want)
    for c0 in range(0, cols, 64):  # the kernel's column chunks
        assert torch.equal(gl_attn.emulate_a_operand(page, rows, cols, c0, 64, bits=4).double(), want[:, c0:c0 + 64])
    assert not torch.equal(gl_attn.emulate_a_operand(ref.pack_mma16(codes.flip(0), 4), rows, cols, bits=4), got)


def test_a_operand_emulation_sees_a_wrong_order():
    """The check above can fail: the transposed codes' page does not give the operand."""
    torch.manual_seed(0)
    codes = torch.randint(0, 4, (128, 128), dtype=torch.uint8)
    want = gl_attn.emulate_a_operand(ref.pack_mma16(codes), 128, 128)
    assert not torch.equal(gl_attn.emulate_a_operand(ref.pack_mma16(codes.t().contiguous()), 128, 128), want)


@pytest.mark.parametrize("gran", ["token", "channel"])
@pytest.mark.parametrize("hq,hkv,d,p", [(8, 2, 128, 128), (4, 1, 64, 64), (16, 1, 128, 64), (3, 1, 256, 128)])
@pytest.mark.parametrize("key_bits", [2, 4])
def test_emulated_kernel_within_budget(gran, hq, hkv, d, p, key_bits):
    lay = _mma(hkv, d, gran, sink=16, window=32, page_size=p).with_key_bits(key_bits)
    tr = LayerTransform.identity(hkv, d, k_clip=0.95, v_clip=0.9)
    lengths = [0, 3, 16 + 32 + p + 1, 16 + 32 + 3 * p + 17]
    torch.manual_seed(hq * d + p)
    st = ragged_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), hq, d) * 2
    got = gl_attn.emulate(q, st, lay, d**-0.5)
    assert torch.equal(got[0], torch.zeros(hq, d)), "an empty sequence must give zeros"
    check_attention_budget(got, q, st, lay, tr, d**-0.5, f"gluon emulation {gran} {hq}/{hkv} d={d} p={p} k{key_bits}")


@pytest.mark.parametrize("gran", ["token", "channel"])
@pytest.mark.parametrize("key_bits", [2, 4])
def test_emulated_kernel_two_groups_a_row_within_budget(gran, key_bits):
    """head_dim 256 with the default two token groups of 128 a row (Gemma 3): each key chunk scaled by its group,
    each half of the value dims by its group's ``p·s_v``, within budget; a wrong group (both halves with the first
    group's value params) is out of it."""
    from dataclasses import replace

    lay = KVCacheLayout.default(2, 256, gran, sink=16, window=32, page_size=64, packing="mma16")
    lay = lay.with_key_bits(key_bits)
    assert lay.value.group_size == 128 and (gran == "channel" or lay.key.group_size == 128)
    checks.check_hopper_layout(lay, 6)
    tr = LayerTransform.identity(2, 256, k_clip=0.95, v_clip=0.9)
    lengths = [16 + 32 + 64 + 5, 16 + 32 + 3 * 64 + 17]
    torch.manual_seed(key_bits)
    st = ragged_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), 6, 256) * 2
    got = gl_attn.emulate(q, st, lay, 256**-0.5)
    check_attention_budget(got, q, st, lay, tr, 256**-0.5, f"gluon emulation two groups {gran} k{key_bits}")
    vp = st.v_params.clone()
    vp[..., 1, :] = vp[..., 0, :]
    wrong = gl_attn.emulate(q, replace(st, v_params=vp), lay, 256**-0.5)
    assert (wrong - got).abs().max() > 1e-2, "the check must see a group mix-up"
