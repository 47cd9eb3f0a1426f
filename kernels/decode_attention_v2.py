"""Decode attention v2: the Triton twin of ``reference.decode_attention`` over ``mma16`` pages.

Same interface and semantics as :mod:`.decode_attention` (v1): one softmax over each sequence's BF16 sink,
its INT2 pages (through the block table) and its BF16 recent ring, split-K over pages with a log-sum-exp
merge (v1's ``_merge_kernel``, the same partials layout). What changes is the page packing it reads
(``RowFormat.packing == "mma16"``, defined in ``reference.pack_mma16``) and the orientation of the dots:

* keys on the MMA's M: ``S^T [P, GQ] = K_c [P, D] · (q·s)^T [D, GQ]`` (token keys: the per-token scale and
  ``lo·Σq`` applied to the ``[P, GQ]`` result; channel keys: the query scaled by the page's channel scales
  once, ``Σ q·lo`` added), the GQA query heads on N;
* values with dims on M: ``O^T [D, GQ] += V_c^T [D, P] · (p·s_v)^T [P, GQ]`` plus ``Σ_t p_t lo_t``.

So each page's K codes are read as the ``[P, D]`` A operand and its V codes as the ``[D, P]`` A operand, in
the order a thread's A fragment wants them: each 32-bit word holds the 16 codes of two 16x16 tiles of one
thread, and one lane's 16 bytes are contiguous (:mod:`.mma16`). Plain Triton chooses the register layouts
itself, so whether the unpacked codes reach the MMA without a shared-memory round trip is the compiler's
decision here; a Gluon / inline-PTX version would pin it (``benchmarks/NOTES-kernels.md``, v2 section).

Arithmetic: dot operands fp16 (codes 0..3 and levels are exact in fp16; queries scaled by
``sm_scale·log2(e)``; ``p·s``), accumulation fp32, like v1, so the CPU interpreter and the GPU compute the
same thing. ``sm_scale`` is a constexpr, no host synchronisation, capturable in a CUDA graph.

Two split kernels read the same pages: ``_decode_split_v2f_kernel`` ("fields", the default and the launch
plan's ``DECODE_SPLIT_V2``) splits every page dot by mma16 field, so each dot operand is an elementwise function
of the loaded 32-bit words (two codes of one ``half2`` register per field) and only the queries and the
probabilities are permuted to match; ``_decode_split_v2_kernel`` ("tile") unpacks the codes into one logical
``[P, D]`` tile first (simpler, ~2x the instructions: benchmarks/NOTES-kernels.md).

Status: written and tested under ``TRITON_INTERPRET=1`` on the CPU (tests/kernels/test_decode_attention_v2.py);
compiled for sm_90 by Triton 3.9 and 3.6 on the CPU; run on the H200 (tests/gpu, BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import decode_attention as _v1
from . import decode_attention_gl as _gl
from .aot import launch_plan as _plan
from .decode_attention import check_decode_inputs, launch_split_merge, window_block
from .layout import KVCacheLayout, PagedKV
from .mma16 import load_mma16

BF16_CHUNK = _plan.BF16_CHUNK
SPLIT_WARPS = _plan.DECODE_SPLIT_V2.num_warps
SPLIT_STAGES = _plan.DECODE_SPLIT_V2.num_stages
#: GQA ratios (query heads per KV head) the v2 kernel is built for; others: v1 or a clear error.
GQ_SUPPORTED = (1, 2, 3, 4, 5, 6, 7, 8, 16)
#: head dims the v2 kernel is built for (multiples of 32, at most 256 values per row).
HEAD_DIMS_SUPPORTED = (64, 128, 256)


@triton.jit
def _levels(c, l0, l1, l2, l3, CODEBOOK: tl.constexpr):
    """Codes (int32) -> fp16 operand: the code itself (uniform levels, exact) or the fitted level."""
    if CODEBOOK:
        return tl.where(c == 0, l0, tl.where(c == 1, l1, tl.where(c == 2, l2, l3))).to(tl.float16)
    else:
        return c.to(tl.float16)


@triton.jit
def _token_pair(params_ptr, word_off, ok, P: tl.constexpr):
    """Per-token fp16 ``(scale, lo)`` of one page-head as fp32 ``[P]`` each, read as one 32-bit word per token
    (little-endian: the scale is the low half)."""
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word_off + tl.arange(0, P), mask=ok, other=0)
    scale = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    lo = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, lo


@triton.jit
def _query(q_ptr, rot_ptr, dscale_ptr, b, h, H_KV: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr,
           D: tl.constexpr, SM_SCALE: tl.constexpr, ROTATE_Q: tl.constexpr):
    """The ``GQ`` query heads of KV head ``h`` (rows past ``GQ`` zero), rotated if ``ROTATE_Q``, times
    ``sm_scale·log2(e)``: fp16 ``[GQ_PAD, D]``."""
    H: tl.constexpr = H_KV * GQ
    g = tl.arange(0, GQ_PAD)
    gmask = g < GQ
    dd = tl.arange(0, D)
    qrow = (b * H + h * GQ + g).to(tl.int64) * D
    qf = tl.load(q_ptr + qrow[:, None] + dd[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)  # [GQ_PAD, D]
    if ROTATE_Q:
        rot = tl.load(rot_ptr + h * D * D + dd[:, None] * D + dd[None, :])
        qf = tl.dot(qf, rot, input_precision="ieee") / tl.load(dscale_ptr + h * D + dd)[None, :]
    qscale: tl.constexpr = SM_SCALE * 1.4426950408889634
    return (qf * qscale).to(tl.float16)


@triton.jit
def _window_split(q16, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr, num_pages_ptr,
                  recent_len_ptr, b, h, c, H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, S0: tl.constexpr,
                  RC: tl.constexpr, BN: tl.constexpr):
    """Attention of ``q16 [GQ_PAD, D]`` over BF16 chunk ``c`` (:func:`.decode_attention.window_block`): returns
    ``m, l [GQ_PAD]`` (log2 units) and the unnormalised output ``[GQ_PAD, D]``."""
    dd = tl.arange(0, D)
    tb = tl.arange(0, BN)
    kb, vb, tmask = window_block(sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr, num_pages_ptr,
                                 recent_len_ptr, b, h, c, tb, H_KV, D, P, S0, RC, BN)
    rows = tb[:, None] * D + dd[None, :]
    kk = tl.load(kb + rows, mask=tmask[:, None], other=0.0).to(tl.float16)  # [BN, D]
    scb = tl.dot(q16, tl.trans(kk))  # [GQ_PAD, BN]
    scb = tl.where(tmask[None, :], scb, float("-inf"))
    m = tl.max(scb, axis=1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    pw_ = tl.exp2(scb - m_use[:, None])
    l = tl.sum(pw_, axis=1)
    vv = tl.load(vb + rows, mask=tmask[:, None], other=0.0).to(tl.float16)
    return m, l, tl.dot(pw_.to(tl.float16), vv)  # [GQ_PAD, D]


@triton.jit
def _store_partial(part_o_ptr, part_lse_ptr, m, l, out, b, h, s, n_splits, H_KV: tl.constexpr, GQ: tl.constexpr,
                   GQ_PAD: tl.constexpr, D: tl.constexpr):
    """Write split ``s``'s normalised output ``out / l`` and its log2-sum-exp ``m + log2(l)`` (``-inf`` and
    zeros when nothing was attended) for the ``GQ`` query heads of KV head ``h``."""
    H: tl.constexpr = H_KV * GQ
    g = tl.arange(0, GQ_PAD)
    gmask = g < GQ
    dd = tl.arange(0, D)
    nonempty = l > 0.0
    inv = tl.where(nonempty, 1.0 / l, 0.0)
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    prow = ((b * H + h * GQ + g).to(tl.int64) * n_splits + s)
    tl.store(part_lse_ptr + prow, lse, mask=gmask)
    tl.store(part_o_ptr + prow[:, None] * D + dd[None, :], out * inv[:, None], mask=gmask[:, None])


@triton.jit
def _decode_split_v2_kernel(
    q_ptr, rot_ptr, dscale_ptr,
    sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
    k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
    block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
    part_o_ptr, part_lse_ptr,
    max_pages, pages_per_split, n_page_splits, n_splits,
    H_KV: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    S0: tl.constexpr, RC: tl.constexpr, BN: tl.constexpr, SM_SCALE: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_CODEBOOK: tl.constexpr, V_CODEBOOK: tl.constexpr, ROTATE_Q: tl.constexpr,
):
    """Partial attention of one (sequence, KV head, split) over mma16 pages. Grid ``(B * H_kv, n_splits)``.

    Parameters: exactly v1's ``_decode_split_kernel`` (same order, same tensors; codes in mma16 order: keys
    ``[P, D]``, values ``[D, P]`` per page-head), without its FAST_UNPACK and NB constexprs. Split
    ``s < n_page_splits`` streams pages ``[s * pages_per_split, ...)`` one per loop iteration; the others take
    one ``BN``-token chunk of the sink or the recent ring. Writes the normalised partial output
    ``part_o [B, H, n_splits, D]`` and its log2-sum-exp ``part_lse [B, H, n_splits]`` (v1's merge reads them).
    """
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H_KV
    h = bh % H_KV
    dd = tl.arange(0, D)
    q16 = _query(q_ptr, rot_ptr, dscale_ptr, b, h, H_KV, GQ, GQ_PAD, D, SM_SCALE, ROTATE_Q)  # [GQ_PAD, D]
    if s < n_page_splits:
        # mma16 row-block grouping of the K [P, D] and V [D, P] matrices (reference.mma16_group)
        KB0: tl.constexpr = 128 // D if D < 128 else 1
        KMB: tl.constexpr = KB0 if (P // 16) % KB0 == 0 else 1
        VB0: tl.constexpr = 128 // P if P < 128 else 1
        VMB: tl.constexpr = VB0 if (D // 16) % VB0 == 0 else 1
        kl0 = tl.load(k_levels_ptr + h * 4 + 0)
        kl1 = tl.load(k_levels_ptr + h * 4 + 1)
        kl2 = tl.load(k_levels_ptr + h * 4 + 2)
        kl3 = tl.load(k_levels_ptr + h * 4 + 3)
        vl0 = tl.load(v_levels_ptr + h * 4 + 0)
        vl1 = tl.load(v_levels_ptr + h * 4 + 1)
        vl2 = tl.load(v_levels_ptr + h * 4 + 2)
        vl3 = tl.load(v_levels_ptr + h * 4 + 3)
        q32 = q16.to(tl.float32)
        qsum = tl.sum(q32, axis=1)  # [GQ_PAD]
        qt = tl.trans(q16)  # [D, GQ_PAD]: the B operand of the transposed scores
        m = tl.full([GQ_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GQ_PAD], tl.float32)
        acc = tl.zeros([D, GQ_PAD], tl.float32)  # O^T
        acclo = tl.zeros([GQ_PAD], tl.float32)
        start = s * pages_per_split
        end = tl.minimum(start + pages_per_split, tl.load(num_pages_ptr + b))
        for pg in range(start, end):
            page = tl.load(block_table_ptr + b.to(tl.int64) * max_pages + pg).to(tl.int64)
            ph = page * H_KV + h
            code_off = tl.multiple_of(ph * (P * D // 4), 16)
            kc = _levels(load_mma16(k_codes_ptr + code_off, 0, 0, P, D, P, D, KMB, True), kl0, kl1, kl2, kl3,
                         K_CODEBOOK)  # [P, D]
            vc = _levels(load_mma16(v_codes_ptr + code_off, 0, 0, D, P, D, P, VMB, True), vl0, vl1, vl2, vl3,
                         V_CODEBOOK)  # [D, P]
            if K_CHANNEL:
                pw = tl.multiple_of(ph * (2 * D), 16)
                ks = tl.load(k_params_ptr + pw + dd).to(tl.float32)  # [D] channel scales
                klo = tl.load(k_params_ptr + pw + D + dd).to(tl.float32)
                qks = tl.trans((q32 * ks[None, :]).to(tl.float16))  # [D, GQ_PAD]
                const = tl.sum(q32 * klo[None, :], axis=1)  # [GQ_PAD]
                st_ = tl.dot(kc, qks) + const[None, :]  # [P, GQ_PAD]
            else:
                ks, klo = _token_pair(k_params_ptr, ph * P, True, P)
                st_ = tl.dot(kc, qt) * ks[:, None] + klo[:, None] * qsum[None, :]
            m_new = tl.maximum(m, tl.max(st_, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            pt = tl.exp2(st_ - m_use[None, :])  # [P, GQ_PAD]
            l = l * alpha + tl.sum(pt, axis=0)
            m = m_new
            vs, vlo = _token_pair(v_params_ptr, ph * P, True, P)
            pv = (pt * vs[:, None]).to(tl.float16)  # [P, GQ_PAD]
            acc = tl.dot(vc, pv, acc * alpha[None, :])  # [D, GQ_PAD]
            acclo = acclo * alpha + tl.sum(pt * vlo[:, None], axis=0)
        out = tl.trans(acc) + acclo[:, None]  # [GQ_PAD, D]
    else:
        m, l, out = _window_split(q16, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr,
                                  num_pages_ptr, recent_len_ptr, b, h, s - n_page_splits, H_KV, D, P, S0, RC, BN)
    _store_partial(part_o_ptr, part_lse_ptr, m, l, out, b, h, s, n_splits, H_KV, GQ, GQ_PAD, D)


# ---- the field-split variant: every dot operand an elementwise function of the loaded words ----------------


@triton.jit
def _halves(base, blk, w, lane, e, MB: tl.constexpr, W: tl.constexpr):
    """uint16 halves ``e`` of the mma16 words at row block ``blk``, word ``w`` of lane ``lane`` (broadcast index
    tensors): half ``e`` of a word holds, in its bits ``2k, 2k + 1``, the code of column ``2c + e`` of field ``k``."""
    idx = 2 * (((blk // MB * 32 + lane) * MB + blk % MB) * W + w) + e
    return tl.load(base.to(tl.pointer_type(tl.uint16)) + idx)


#: PTX for the uniform fields on the GPU: two uint16 halves arrive packed in one 32-bit register (Triton packs
#: sub-4-byte elements), and one AND with the field mask on both halves leaves the fp16x2 subnormal pair; the
#: pairing of elements is irrelevant because the same mask applies to both halves. ``_SHR8`` moves fields 4..7
#: down by 8 bits (the high half's low byte lands in bits 8..15 of the low half, which every mask clears).
_AND_ASM = [tl.constexpr(f"and.b32 $0, $1, {hex(0x00030003 << (2 * k))};") for k in range(4)]
_AND0, _AND1, _AND2, _AND3 = _AND_ASM
_SHR8 = tl.constexpr("shr.b32 $0, $1, 8;")


@triton.jit
def _and_field(x, J: tl.constexpr):
    """``x & (3 << 2J)`` on both halves of each packed pair, as fp16 (inline PTX, CUDA only)."""
    if J == 0:
        return tl.inline_asm_elementwise(_AND0, "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    elif J == 1:
        return tl.inline_asm_elementwise(_AND1, "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    elif J == 2:
        return tl.inline_asm_elementwise(_AND2, "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_AND3, "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _high(h, FAST: tl.constexpr):
    """``h >> 8`` per uint16 half (fields 4..7); on the GPU one shift of the packed pair."""
    if FAST:
        return tl.inline_asm_elementwise(_SHR8, "=r,r", [h], dtype=tl.uint16, is_pure=True, pack=2)
    else:
        return h >> 8


@triton.jit
def _field(h, h8, K: tl.constexpr, l0, l1, l2, l3, CODEBOOK: tl.constexpr, FAST: tl.constexpr):
    """Field ``K`` of the halves ``h`` (``h8 = _high(h)``) as the fp16 dot operand. Uniform codes: the masked
    bits read as an fp16 subnormal, ``c·4^(K mod 4)·2^-24`` exactly (fields 4..7 from ``h8``, so the exponent
    bits stay zero); with ``FAST`` (CUDA) one AND per two codes. Fitted levels: their fp16 value."""
    if CODEBOOK:
        return _levels(((h >> (2 * K)) & 3).to(tl.int32), l0, l1, l2, l3, True)
    elif FAST:
        if K < 4:
            return _and_field(h, K)
        else:
            return _and_field(h8, K - 4)
    else:
        if K < 4:
            x = h & (3 << (2 * K))
        else:
            x = h8 & (3 << (2 * (K - 4)))
        return x.to(tl.int16, bitcast=True).to(tl.float16, bitcast=True)


@triton.jit
def _qsel(q16, GQ_PAD: tl.constexpr, D: tl.constexpr):
    """The four ``[D/4, GQ_PAD]`` B operands of the key field dots from ``q16 [GQ_PAD, D]``: tile ``(kb, hc)``
    holds dims ``32w + 16kb + 8hc + 2tq + e`` in row order ``(w, tq, e)``. Returned as (kb, hc) = 00, 01, 10, 11."""
    x = tl.reshape(q16, (GQ_PAD, D // 32, 2, 2, 4, 2))  # (g', w, kb, hc, tq, e)
    x = tl.permute(x, (0, 1, 4, 5, 2, 3))  # (g', w, tq, e, kb, hc)
    x0, x1 = tl.split(x)  # hc
    x00, x10 = tl.split(x0)  # kb (hc = 0)
    x01, x11 = tl.split(x1)  # kb (hc = 1)
    return (tl.trans(tl.reshape(x00, (GQ_PAD, D // 4))), tl.trans(tl.reshape(x01, (GQ_PAD, D // 4))),
            tl.trans(tl.reshape(x10, (GQ_PAD, D // 4))), tl.trans(tl.reshape(x11, (GQ_PAD, D // 4))))


@triton.jit
def _dsel(D: tl.constexpr):
    """Dims of the four key tiles of :func:`_qsel` as ``[D/4]`` index vectors, (kb, hc) = 00, 01, 10, 11."""
    c = tl.arange(0, D // 4)
    base = 32 * (c // 8) + 2 * ((c // 2) % 4) + c % 2  # (w, tq, e) -> 32w + 2tq + e
    return base, base + 8, base + 16, base + 24


@triton.jit
def _psel(p, R: tl.constexpr, GQ_PAD: tl.constexpr):
    """Rows ``16i + 8hr' + g`` of ``p [R, GQ_PAD]`` split by ``hr'``: two ``[R/2, GQ_PAD]`` tiles in row order (i, g)."""
    x = tl.permute(tl.reshape(p, (R // 16, 2, 8, GQ_PAD)), (0, 2, 3, 1))
    a, b = tl.split(x)
    return tl.reshape(a, (R // 2, GQ_PAD)), tl.reshape(b, (R // 2, GQ_PAD))


@triton.jit
def _decode_split_v2f_kernel(
    q_ptr, rot_ptr, dscale_ptr,
    sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
    k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
    block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
    part_o_ptr, part_lse_ptr,
    max_pages, pages_per_split, n_page_splits, n_splits,
    H_KV: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    S0: tl.constexpr, RC: tl.constexpr, BN: tl.constexpr, SM_SCALE: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_CODEBOOK: tl.constexpr, V_CODEBOOK: tl.constexpr, ROTATE_Q: tl.constexpr,
    FAST_UNPACK: tl.constexpr,
):
    """:func:`_decode_split_v2_kernel` with the page dots split by mma16 field (same parameters, same results
    within rounding): each 32-bit word ``(blk, lane, w)`` of a page gives, for field ``(kb, hc, hr)``, the two
    codes of one ``half2`` register, so every key dot is ``[P/2, D/4] x [D/4, GQ]`` over the rows
    ``16i + 8hr' + g`` (token ``16(2i + hr') + 8hr + g``) and every value dot ``[D/2, P/4] x [P/4, GQ]``; the
    operands are elementwise functions of the words (no gather of codes), the queries and probabilities are
    permuted to match once per program / page. Uniform codes are exact fp16 subnormals ``c·4^(2hc + hr)·2^-24``
    (the 2^24 is folded into the key scale and the output, the powers of 4 into the ``hc = 1`` operands and the
    ``hr = 1`` results). ``FAST_UNPACK`` (CUDA, uniform codes): the field masks as inline PTX on packed pairs, one
    AND per two codes; otherwise the same values from plain Triton ops (the CPU interpreter's path).
    Parameters: as :func:`_decode_split_v2_kernel`, plus the constexpr ``FAST_UNPACK``."""
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H_KV
    h = bh % H_KV
    q16 = _query(q_ptr, rot_ptr, dscale_ptr, b, h, H_KV, GQ, GQ_PAD, D, SM_SCALE, ROTATE_Q)  # [GQ_PAD, D]
    if s < n_page_splits:
        KB0: tl.constexpr = 128 // D if D < 128 else 1
        KMB: tl.constexpr = KB0 if (P // 16) % KB0 == 0 else 1
        VB0: tl.constexpr = 128 // P if P < 128 else 1
        VMB: tl.constexpr = VB0 if (D // 16) % VB0 == 0 else 1
        RK: tl.constexpr = P // 2  # key field rows (token halves)
        CK: tl.constexpr = D // 8  # key words per field row
        RV: tl.constexpr = D // 2
        CV: tl.constexpr = P // 8
        kl0 = tl.load(k_levels_ptr + h * 4 + 0)
        kl1 = tl.load(k_levels_ptr + h * 4 + 1)
        kl2 = tl.load(k_levels_ptr + h * 4 + 2)
        kl3 = tl.load(k_levels_ptr + h * 4 + 3)
        vl0 = tl.load(v_levels_ptr + h * 4 + 0)
        vl1 = tl.load(v_levels_ptr + h * 4 + 1)
        vl2 = tl.load(v_levels_ptr + h * 4 + 2)
        vl3 = tl.load(v_levels_ptr + h * 4 + 3)
        if K_CODEBOOK:
            KU = 1.0
        else:
            KU = 16777216.0
        if V_CODEBOOK:
            VU = 1.0
        else:
            VU = 16777216.0
        qsum = tl.sum(q16.to(tl.float32), axis=1)  # [GQ_PAD]
        q00, q01, q10, q11 = _qsel(q16, GQ_PAD, D)  # [D/4, GQ_PAD] each, (kb, hc)
        d00, d01, d10, d11 = _dsel(D)
        # word coordinates of the field rows (i, hr', g) and columns (j, hc', tq): blk = 2i + hr', w = 2j + hc'
        rk = tl.arange(0, RK)[:, None]
        ck = tl.arange(0, 2 * CK)[None, :] // 2  # operand column 2c + e -> word c
        k_blk = 2 * (rk // 16) + (rk // 8) % 2
        k_w = 2 * (ck // 8) + (ck // 4) % 2
        k_lane = 4 * (rk % 8) + ck % 4
        k_e = tl.arange(0, 2 * CK)[None, :] % 2
        rv = tl.arange(0, RV)[:, None]
        cv = tl.arange(0, 2 * CV)[None, :] // 2
        v_blk = 2 * (rv // 16) + (rv // 8) % 2
        v_w = 2 * (cv // 8) + (cv // 4) % 2
        v_lane = 4 * (rv % 8) + cv % 4
        v_e = tl.arange(0, 2 * CV)[None, :] % 2
        # uniform codes: fields k = 4kb + 2hc + hr read as c·4^(2hc + hr)·2^-24; the 4^-2hc goes into the hc = 1
        # B operands, the 4^-hr into the hr = 1 results (exact powers of two)
        if K_CODEBOOK:
            KH = 1.0
            KR = 1.0
        else:
            KH = 0.0625
            KR = 0.25
        if V_CODEBOOK:
            VH = 1.0
            VR = 1.0
        else:
            VH = 0.0625
            VR = 0.25
        r1 = tl.arange(0, RK)
        tok0 = 32 * (r1 // 16) + 16 * ((r1 // 8) % 2) + r1 % 8  # token of field row r, hr = 0 (hr = 1: + 8)
        m = tl.full([GQ_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GQ_PAD], tl.float32)
        acc0 = tl.zeros([RV, GQ_PAD], tl.float32)  # O^T rows 16(2i + hr') + g     (hr_v = 0)
        acc1 = tl.zeros([RV, GQ_PAD], tl.float32)  # O^T rows 16(2i + hr') + 8 + g (hr_v = 1)
        acclo = tl.zeros([GQ_PAD], tl.float32)
        start = s * pages_per_split
        end = tl.minimum(start + pages_per_split, tl.load(num_pages_ptr + b))
        for pg in range(start, end):
            page = tl.load(block_table_ptr + b.to(tl.int64) * max_pages + pg).to(tl.int64)
            ph = page * H_KV + h
            code_off = tl.multiple_of(ph * (P * D // 4), 16)
            hk = _halves(k_codes_ptr + code_off, k_blk, k_w, k_lane, k_e, KMB, D // 32)  # [RK, 2CK] uint16
            hv = _halves(v_codes_ptr + code_off, v_blk, v_w, v_lane, v_e, VMB, P // 32)  # [RV, 2CV]
            hk8 = _high(hk, FAST_UNPACK and not K_CODEBOOK)
            hv8 = _high(hv, FAST_UNPACK and not V_CODEBOOK)
            if K_CHANNEL:
                pw = ph * (2 * D)
                a00 = (q00.to(tl.float32) * tl.load(k_params_ptr + pw + d00).to(tl.float32)[:, None]).to(tl.float16)
                a01 = (q01.to(tl.float32) * (tl.load(k_params_ptr + pw + d01).to(tl.float32) * KH)[:, None]).to(tl.float16)
                a10 = (q10.to(tl.float32) * tl.load(k_params_ptr + pw + d10).to(tl.float32)[:, None]).to(tl.float16)
                a11 = (q11.to(tl.float32) * (tl.load(k_params_ptr + pw + d11).to(tl.float32) * KH)[:, None]).to(tl.float16)
                const = tl.sum(q00.to(tl.float32) * tl.load(k_params_ptr + pw + D + d00).to(tl.float32)[:, None], axis=0)
                const += tl.sum(q01.to(tl.float32) * tl.load(k_params_ptr + pw + D + d01).to(tl.float32)[:, None], axis=0)
                const += tl.sum(q10.to(tl.float32) * tl.load(k_params_ptr + pw + D + d10).to(tl.float32)[:, None], axis=0)
                const += tl.sum(q11.to(tl.float32) * tl.load(k_params_ptr + pw + D + d11).to(tl.float32)[:, None], axis=0)
            else:
                a00 = q00
                a01 = (q01.to(tl.float32) * KH).to(tl.float16)
                a10 = q10
                a11 = (q11.to(tl.float32) * KH).to(tl.float16)
            # field k = 4kb + 2hc + hr
            s0 = tl.dot(_field(hk, hk8, 0, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK), a00)
            s0 = tl.dot(_field(hk, hk8, 2, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK), a01, s0)
            s0 = tl.dot(_field(hk, hk8, 4, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK), a10, s0)
            s0 = tl.dot(_field(hk, hk8, 6, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK), a11, s0)
            s1 = tl.dot(_field(hk, hk8, 1, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK), a00)
            s1 = tl.dot(_field(hk, hk8, 3, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK), a01, s1)
            s1 = tl.dot(_field(hk, hk8, 5, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK), a10, s1)
            s1 = tl.dot(_field(hk, hk8, 7, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK), a11, s1)
            s1 = s1 * KR
            if K_CHANNEL:
                s0 = s0 * KU + const[None, :]
                s1 = s1 * KU + const[None, :]
            else:
                ks0, klo0 = _token_pair(k_params_ptr, ph * P + tok0, True, 1)
                ks1, klo1 = _token_pair(k_params_ptr, ph * P + tok0 + 8, True, 1)
                s0 = s0 * (ks0 * KU)[:, None] + klo0[:, None] * qsum[None, :]
                s1 = s1 * (ks1 * KU)[:, None] + klo1[:, None] * qsum[None, :]
            m_new = tl.maximum(m, tl.maximum(tl.max(s0, axis=0), tl.max(s1, axis=0)))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            p0 = tl.exp2(s0 - m_use[None, :])  # [RK, GQ_PAD], tokens tok0
            p1 = tl.exp2(s1 - m_use[None, :])  # tokens tok0 + 8
            l = l * alpha + tl.sum(p0, axis=0) + tl.sum(p1, axis=0)
            m = m_new
            vs0, vlo0 = _token_pair(v_params_ptr, ph * P + tok0, True, 1)
            vs1, vlo1 = _token_pair(v_params_ptr, ph * P + tok0 + 8, True, 1)
            acclo = acclo * alpha + tl.sum(p0 * vlo0[:, None], axis=0) + tl.sum(p1 * vlo1[:, None], axis=0)
            # value B operands: tokens 32w + 16kb + 8hc + 2tq + e in row order (w, tq, e); hc = the key half hr
            b00, b10 = _psel((p0 * vs0[:, None]).to(tl.float16), RK, GQ_PAD)  # (kb 0, hc 0), (kb 1, hc 0)
            b01, b11 = _psel((p1 * (vs1 * VH)[:, None]).to(tl.float16), RK, GQ_PAD)  # (kb 0, hc 1), (kb 1, hc 1)
            acc0 = acc0 * alpha[None, :]
            acc1 = acc1 * alpha[None, :]
            acc0 = tl.dot(_field(hv, hv8, 0, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b00, acc0)
            acc0 = tl.dot(_field(hv, hv8, 2, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b01, acc0)
            acc0 = tl.dot(_field(hv, hv8, 4, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b10, acc0)
            acc0 = tl.dot(_field(hv, hv8, 6, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b11, acc0)
            acc1 = tl.dot(_field(hv, hv8, 1, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b00, acc1)
            acc1 = tl.dot(_field(hv, hv8, 3, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b01, acc1)
            acc1 = tl.dot(_field(hv, hv8, 5, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b10, acc1)
            acc1 = tl.dot(_field(hv, hv8, 7, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b11, acc1)
        # O^T rows (i, hr', g) of acc_hr -> dims 32i + 16hr' + 8hr + g
        ot = tl.reshape(tl.join(acc0, acc1 * VR), (D // 32, 2, 8, GQ_PAD, 2))  # (i, hr', g, g', hr)
        out = tl.reshape(tl.permute(ot, (3, 0, 1, 4, 2)), (GQ_PAD, D)) * VU + acclo[:, None]
    else:
        m, l, out = _window_split(q16, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr,
                                  num_pages_ptr, recent_len_ptr, b, h, s - n_page_splits, H_KV, D, P, S0, RC, BN)
    _store_partial(part_o_ptr, part_lse_ptr, m, l, out, b, h, s, n_splits, H_KV, GQ, GQ_PAD, D)


# ---- wrapper ------------------------------------------------------------------------------------------------


def check_decode_v2_layout(layout: KVCacheLayout, num_heads: int) -> None:
    """Raise for what the v2 kernel does not handle: pages not both mma16 (``ValueError``: read them with
    v1), an unsupported head_dim or GQA ratio (``NotImplementedError``), token groups smaller than a row, codes
    wider than 2 bits (``NotImplementedError``: 4-bit keys are linear pages, read by v1)."""
    if layout.key.bits != 2 or layout.value.bits != 2:
        raise NotImplementedError(
            f"decode_attention_v2: reads 2-bit pages only, the layout has {layout.key.bits}-bit keys and "
            f"{layout.value.bits}-bit values (4-bit keys are 'linear' pages: kernels.decode_attention, v1)"
        )
    if layout.key.packing != "mma16" or layout.value.packing != "mma16":
        raise ValueError(
            f"decode_attention_v2: reads 'mma16' pages, the layout has key {layout.key.packing!r}, value "
            f"{layout.value.packing!r} (linear pages: kernels.decode_attention, v1)"
        )
    d, p = layout.head_dim, layout.page_size
    if d not in HEAD_DIMS_SUPPORTED:
        raise NotImplementedError(f"decode_attention_v2: head_dim {list(HEAD_DIMS_SUPPORTED)} supported, got {d}")
    if p not in (32, 64, 128):
        raise NotImplementedError(f"decode_attention_v2: page_size 32, 64 or 128 supported, got {p}")
    if num_heads % layout.num_kv_heads or num_heads // layout.num_kv_heads not in GQ_SUPPORTED:
        raise NotImplementedError(
            f"decode_attention_v2: {num_heads} query heads over {layout.num_kv_heads} KV heads; GQA ratios "
            f"{list(GQ_SUPPORTED)} supported"
        )
    for name, fmt in (("key", layout.key), ("value", layout.value)):
        if fmt.granularity == "token" and fmt.group_size != d:
            raise NotImplementedError(
                f"decode_attention_v2: {name} group_size must equal head_dim ({d}), got {fmt.group_size}"
            )


def decode_attention(
    q: torch.Tensor,
    state: PagedKV,
    layout: KVCacheLayout,
    k_levels: torch.Tensor,
    v_levels: torch.Tensor,
    scale: float,
    *,
    codebook: bool | None = None,
    q_rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype = torch.float32,
    pages_per_split: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    variant: str = "fields",
    fast_unpack: bool | None = None,
    maxnreg: int | None = None,
    fused_merge: bool | None = None,
) -> torch.Tensor:
    """``reference.decode_attention`` over mma16 pages, split + merge (arguments as v1's ``decode_attention``).

    ``variant``: ``"fields"`` (``_decode_split_v2f_kernel``, page sizes 64 and 128), ``"tile"``
    (``_decode_split_v2_kernel``: the codes unpacked into one logical ``[P, D]`` tile) or ``"gluon"``
    (:mod:`.decode_attention_gl`: CUDA only, uniform codes, ``num_warps=4``, ``num_stages`` = its cp.async stages
    (at least 2)). ``fast_unpack``: the
    fields kernel's inline-PTX field masks (default: on CUDA, uniform levels); False forces the plain path.
    ``maxnreg``: a register cap per thread for the "gluon" kernel's JIT launch (None: the launch plan's
    ``gl_occupancy``, 0: none). ``fused_merge``: the "gluon" kernel merges in each (sequence, KV head)'s last
    program, one launch instead of two (None: the launch plan's ``GL_FUSED_MERGE`` up to ``MERGE_COUNTERS``
    (sequence, KV head) pairs, the merge launched beyond; :func:`merge_counters`).

    Returns ``[B, H, D]`` in ``out_dtype``, stored value basis. Reads no device value on the host.
    """
    rot, dsc, pages_per_split, codebook = check_decode_v2_inputs(
        q, state, layout, k_levels, v_levels, scale, q_rotation, out_dtype, pages_per_split, variant, codebook)
    num_warps, num_stages = launch_options(variant, num_warps, num_stages)
    return launch_decode_v2(
        q, rot, dsc, state.sink_k, state.sink_v, state.recent_k, state.recent_v, state.k_codes, state.k_params,
        state.v_codes, state.v_params, k_levels, v_levels, state.block_table, state.sink_len, state.num_pages,
        state.recent_len, layout.num_kv_heads, layout.page_size, layout.sink, layout.recent_slots, float(scale),
        layout.key.granularity == "channel", codebook, q_rotation is not None, pages_per_split, out_dtype,
        num_warps, num_stages, variant=variant,
        fast_unpack=(q.device.type == "cuda" if fast_unpack is None else fast_unpack) and not codebook,
        maxnreg=maxnreg, fused_merge=fused_merge,
    )


def check_decode_v2_inputs(q, state, layout, k_levels, v_levels, scale, q_rotation, out_dtype, pages_per_split,
                           variant: str, codebook: bool | None):
    """Every check of :func:`decode_attention` before a launch (layout, variant, then v1's packing-independent
    input checks); returns ``(rot, dsc, pages_per_split, codebook)`` as the launch takes them."""
    if variant not in KERNELS:
        raise ValueError(f"variant: expected one of {sorted(KERNELS)}, got {variant!r}")
    if codebook is None:
        codebook = layout.key.codebook or layout.value.codebook
    if q.dim() == 3:  # (other shapes: v1's checks below say what is wrong)
        check_decode_v2_layout(layout, q.shape[1])
        if variant == "gluon":
            _gl.check_gluon_layout(layout, q.shape[1], bool(codebook))
        if pages_per_split is None:
            pages_per_split = default_pages_per_split(variant, q.shape[0], layout.num_kv_heads,
                                                      state.block_table.shape[-1], q.device, 1, layout.head_dim)
    rot, dsc, pages_per_split = check_decode_inputs(
        q, state, _as_linear(layout), k_levels, v_levels, scale, q_rotation, out_dtype, pages_per_split, 1
    )  # v1's input checks (shapes, dtypes, devices) are packing-independent
    if variant == "gluon":  # 16-byte cp.async of every page: the JIT cannot fall back to narrower copies
        for name in ("k_codes", "v_codes", "k_params", "v_params"):
            off = getattr(state, name).data_ptr() % 16
            if off:
                raise ValueError(f"state.{name}: the 'gluon' kernel copies pages 16 bytes at a time; the buffer must "
                                 f"start 16-byte aligned, it starts {off} bytes past a boundary (a sliced view?)")
    return rot, dsc, pages_per_split, bool(codebook)


def default_variant(layout: KVCacheLayout, num_heads: int, device: torch.device) -> tuple[str, str]:
    """The mma16 decode kernel a serving setup gets unless it names one: ``("gluon", "")`` (v3, the fastest on
    the H200: BENCHMARKS.md) where it runs, else ``("fields", why not "gluon")``."""
    if "gluon" not in KERNELS:
        return "fields", "this Triton has no Gluon"
    try:
        _gl.check_gluon_layout(layout, num_heads, bool(layout.key.codebook or layout.value.codebook))
        _gl.check_gluon_device(device)
    except NotImplementedError as e:
        return "fields", str(e)
    return "gluon", ""


def default_pages_per_split(variant: str | None, batch: int, num_kv_heads: int, max_pages: int,
                            device: torch.device, page_slots: int = 1, head_dim: int = 128) -> int:
    """Pages per split program: the launch plan's wave rule for the "gluon" kernel (``gl_pages_per_split``),
    v1's rule (``decode_attention.default_pages_per_split``, a multiple of ``page_slots``) for every other."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    if variant == "gluon":
        return _plan.gl_pages_per_split(batch, num_kv_heads, max_pages, sms, head_dim)
    return _v1.default_pages_per_split(batch, num_kv_heads, max_pages, sms, page_slots)


def launch_options(variant: str, num_warps: int | None, num_stages: int | None) -> tuple[int, int]:
    """``(num_warps, num_stages)``: the given ones, else the variant's (the launch plan's DECODE_SPLIT_V2 or
    DECODE_SPLIT_GL)."""
    if variant == "gluon":
        return num_warps or _gl.NUM_WARPS, num_stages or _gl.STAGES
    return num_warps or SPLIT_WARPS, num_stages or SPLIT_STAGES


def _as_linear(layout: KVCacheLayout) -> KVCacheLayout:
    from dataclasses import replace

    return replace(layout, key=replace(layout.key, packing="linear"), value=replace(layout.value, packing="linear"))


def launch_decode_v2(
    q, rot, dsc, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
    block_table, sink_len, num_pages, recent_len, num_kv_heads: int, page_size: int, sink: int,
    recent_slots: int, scale: float, k_channel: bool, codebook: bool, rotate_q: bool, pages_per_split: int,
    out_dtype: torch.dtype, num_warps: int = SPLIT_WARPS, num_stages: int = SPLIT_STAGES, wrap=lambda k: k,
    variant: str = "fields", fast_unpack: bool = False, maxnreg: int | None = None, fused_merge: bool | None = None,
) -> torch.Tensor:
    """Allocate the partials and launch split (v2) + merge (v1's) on validated inputs, or the "gluon" split with
    the merge fused (``fused_merge``, None: ``GL_FUSED_MERGE``). Grid rules: the launch plan's ``DECODE_SPLIT_V2``
    (as v1's split) and ``DECODE_MERGE``."""
    _, hq, d = q.shape
    gq = hq // num_kv_heads
    if variant not in KERNELS:
        raise ValueError(f"variant: expected one of {sorted(KERNELS)}, got {variant!r}")
    if variant == "fields" and page_size < 64:
        raise NotImplementedError(f"decode_attention_v2 'fields': page_size 64 or 128, got {page_size} (use 'tile')")
    extra = dict(FAST_UNPACK=fast_unpack and not codebook) if variant in ("fields", "gluon") else {}
    if variant == "gluon":  # the Gluon kernel (decode_attention_gl): one warpgroup, cp.async stages
        _gl.check_gluon_device(q.device)
        if num_warps != _gl.NUM_WARPS:
            raise ValueError(f"decode_attention_v2 'gluon': num_warps must be {_gl.NUM_WARPS}, got {num_warps}")
        if num_stages < 2:
            raise ValueError(f"decode_attention_v2 'gluon': num_stages (its cp.async stages) must be >= 2, "
                             f"got {num_stages}")
        extra["STAGES"] = num_stages
        maxnreg = _plan.gl_occupancy(d)[0] if maxnreg is None else maxnreg
        if maxnreg:  # a launch option of the JIT, passed beside the constexprs
            extra["maxnreg"] = int(maxnreg)
        if fused_merge is None:  # the plan's choice, where the counters reach
            fused_merge = _plan.GL_FUSED_MERGE and q.shape[0] * num_kv_heads <= MERGE_COUNTERS
    else:
        for name, given in (("maxnreg", maxnreg), ("fused_merge", fused_merge)):
            if given is not None:
                raise ValueError(f"decode_attention_v2: {name} is an option of the 'gluon' kernel, "
                                 f"not of {variant!r}")
    counters = merge_counters(q.device, q.shape[0] * num_kv_heads) if fused_merge else None
    return launch_split_merge(
        _gl.FUSED_KERNEL if fused_merge else KERNELS[variant], q, rot, dsc, sink_k, sink_v, recent_k, recent_v,
        k_codes, k_params, v_codes, v_params, k_levels, v_levels, block_table, sink_len, num_pages, recent_len,
        num_kv_heads, sink, recent_slots, pages_per_split, out_dtype,
        dict(H_KV=num_kv_heads, GQ=gq, GQ_PAD=_plan.gq_pad_v2(gq), D=d, P=page_size, S0=sink, RC=recent_slots,
             BN=BF16_CHUNK, SM_SCALE=float(scale), K_CHANNEL=k_channel, K_CODEBOOK=codebook, V_CODEBOOK=codebook,
             ROTATE_Q=rotate_q, **extra),
        num_warps, num_stages, wrap, counters,
    )


#: the fused merge's counters, one int32 zero per (sequence, KV head) and device (``merge_counters``).
MERGE_COUNTERS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def merge_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """The int32 counters of the fused-merge "gluon" launches on ``device``: ``MERGE_COUNTERS`` zeros, allocated
    once and never freed (captured CUDA graphs keep their address). Each launch's last program of a (sequence,
    KV head) sets that pair's counter back to zero, so launches in one stream order share them; two streams
    running fused-merge launches at the same time must not (they would count into the same pairs).

    The first call must not be inside a CUDA-graph capture (the zero fill would only be recorded, not run):
    one eager launch first, as every warm-up does."""
    if pairs > MERGE_COUNTERS:
        raise ValueError(f"decode_attention_v2 fused merge: {pairs} (sequence, KV head) pairs, at most "
                         f"{MERGE_COUNTERS}; use fused_merge=False")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_attention_v2 fused merge: its counters are allocated by the first launch, "
                               "which must run eagerly, not inside a CUDA-graph capture (run one warm-up step)")
        buf = _COUNTERS[device] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return buf


#: the v2 split kernels by variant name (the launch plan's DECODE_SPLIT_V2 names the default one); "gluon" is
#: decode_attention_gl's kernel (where this Triton has Gluon): same parameters, uniform codes, num_warps 4.
KERNELS = {"tile": _decode_split_v2_kernel, "fields": _decode_split_v2f_kernel}
if _gl.HAVE_GLUON:
    KERNELS["gluon"] = _gl.KERNEL


def decode_attention_any(q, state, layout: KVCacheLayout, k_levels, v_levels, scale: float, **kw) -> torch.Tensor:
    """Dispatch on the page packing: v1 (:mod:`.decode_attention`) for linear pages, v2 for mma16 pages.

    Keyword arguments are those of the chosen wrapper (v1 also takes ``page_slots`` and ``fast_unpack``).
    Mixed packings (keys and values differ) are refused with ``NotImplementedError``.
    """
    if layout.packing == "linear":
        return _v1.decode_attention(q, state, layout, k_levels, v_levels, scale, **kw)
    if layout.packing == "mma16":
        return decode_attention(q, state, layout, k_levels, v_levels, scale, **kw)
    raise NotImplementedError(f"decode attention: keys packed {layout.key.packing!r} and values "
                              f"{layout.value.packing!r}; both linear (v1) or both mma16 (v2) are supported")


__all__ = ["GQ_SUPPORTED", "HEAD_DIMS_SUPPORTED", "KERNELS", "check_decode_v2_inputs", "check_decode_v2_layout",
           "decode_attention", "decode_attention_any", "default_pages_per_split", "default_variant",
           "launch_decode_v2", "launch_options", "merge_counters"]
