"""The portable split kernel's page helpers (``decode/portable.py``'s ``_decode_split_kernel`` calls them; its module
doc explains the arithmetic): ``@triton.jit`` functions, inlined into the kernel.

* code fields as exact fp16 values: :func:`_field_scaled` (2-bit fields, the PTX subnormal trick for uniform codes),
  :func:`_nibble_scaled` (4-bit key pages), :func:`_lev` (fitted levels), and :func:`_key_scores`, a page block's
  scores over the four key quarters;
* :func:`_softmax_step`, the online-softmax update of a split;
* per-token and per-channel parameters read as 32-bit words (prefetched with the codes): :func:`_token_params`,
  :func:`_slot_row`, :func:`_slot_cols`, :func:`_group_params`; :func:`_field_cols`, the row elements a field holds;
* :func:`_grouped_pages`, a split's INT2 pages when a row holds several token groups (``G < D``), with its
  reshapes :func:`_per_group`, :func:`_per_slot`, :func:`_per_slot3`, :func:`_columns`;
* :func:`window_block`, a BF16 sink / recent chunk's rows and mask, shared with the hopper kernel
  (``decode/hopper_kernel.py``).

The names keep their underscores: they are the kernel's private pieces (imported by ``portable.py`` only, whose kernel
body calls them by these names; ``window_block`` is public, the hopper kernel reads it too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..cache_keys import hash_bottom_up


@triton.jit
def _lev(c, l0, l1, l2, l3, CODEBOOK: tl.constexpr):
    """2-bit code -> level as fp32 (uniform levels: the code itself)."""
    if CODEBOOK:
        return tl.where(c == 0, l0, tl.where(c == 1, l1, tl.where(c == 2, l2, l3)))
    else:
        return c.to(tl.float32)


#: PTX for the scaled fields: masking field j in place and moving each byte under a zero byte gives the
#: fp16 *subnormal* ``c·4^j·2^-24`` directly (three instructions for four codes, no shift, no subtract);
#: the kernel folds ``2^24·4^-j`` back in outside the inner products (exact powers of two).
_SUBNORMAL_ASM = [tl.constexpr(
    "{ .reg .b32 t; and.b32 t, $2, " + hex(0x03030303 << (2 * j)) + "; "
    "prmt.b32 $0, t, 0, 0x4140; prmt.b32 $1, t, 0, 0x4342; }"
) for j in range(4)]
_SUB0, _SUB1, _SUB2, _SUB3 = _SUBNORMAL_ASM
#: the same for the two 4-bit nibbles of a byte (4-bit key pages): ``c·16^n·2^-24``, c in 0..15.
_NIBBLE_ASM = [tl.constexpr(
    "{ .reg .b32 t; and.b32 t, $2, " + hex(0x0F0F0F0F << (4 * n)) + "; "
    "prmt.b32 $0, t, 0, 0x4140; prmt.b32 $1, t, 0, 0x4342; }"
) for n in range(2)]
_NIB0, _NIB1 = _NIBBLE_ASM
#: 2^-24, the fp16 subnormal unit
TINY = tl.constexpr(5.960464477539063e-08)


@triton.jit
def _field_scaled(codes, J: tl.constexpr, l0, l1, l2, l3, CODEBOOK: tl.constexpr, FAST: tl.constexpr):
    """Field ``J`` of every byte as fp16: the level (codebook) or ``c·4^J·2^-24`` (uniform codes, exact)."""
    if CODEBOOK:
        return _lev((codes.to(tl.int32) >> (2 * J)) & 3, l0, l1, l2, l3, CODEBOOK).to(tl.float16)
    elif FAST:
        if J == 0:
            return tl.inline_asm_elementwise(_SUB0, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
        elif J == 1:
            return tl.inline_asm_elementwise(_SUB1, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
        elif J == 2:
            return tl.inline_asm_elementwise(_SUB2, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_SUB3, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return ((codes & (3 << (2 * J))).to(tl.float32) * TINY).to(tl.float16)


@triton.jit
def _nibble_scaled(codes, N: tl.constexpr, FAST: tl.constexpr):
    """Nibble ``N`` (0 low, 1 high) of every byte of 4-bit key codes as the exact fp16 ``c·16^N·2^-24``."""
    if FAST:
        if N == 0:
            return tl.inline_asm_elementwise(_NIB0, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_NIB1, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return ((codes & (15 << (4 * N))).to(tl.float32) * TINY).to(tl.float16)


@triton.jit
def _key_scores(ka, kb, b0, b1, b2, b3, l0, l1, l2, l3, KEY_BITS: tl.constexpr, CODEBOOK: tl.constexpr,
                FAST: tl.constexpr):
    """``Σ_j K_j · b_j`` over the four key quarters of a page block: 2-bit codes ``ka`` (quarter ``j`` = field
    ``j`` of each byte, :func:`_field_scaled`; ``kb`` unread), or 4-bit codes (quarters 0 | 2 the low | high
    nibbles of ``ka``, 1 | 3 those of ``kb``, :func:`_nibble_scaled`). The ``b_j`` carry the folded powers of two."""
    if KEY_BITS == 4:
        acc = tl.dot(_nibble_scaled(ka, 0, FAST), b0)
        acc = tl.dot(_nibble_scaled(kb, 0, FAST), b1, acc)
        acc = tl.dot(_nibble_scaled(ka, 1, FAST), b2, acc)
        acc = tl.dot(_nibble_scaled(kb, 1, FAST), b3, acc)
    else:
        acc = tl.dot(_field_scaled(ka, 0, l0, l1, l2, l3, CODEBOOK, FAST), b0)
        acc = tl.dot(_field_scaled(ka, 1, l0, l1, l2, l3, CODEBOOK, FAST), b1, acc)
        acc = tl.dot(_field_scaled(ka, 2, l0, l1, l2, l3, CODEBOOK, FAST), b2, acc)
        acc = tl.dot(_field_scaled(ka, 3, l0, l1, l2, l3, CODEBOOK, FAST), b3, acc)
    return acc


@triton.jit
def _softmax_step(sc, m, den):
    """Online-softmax update for scores ``sc [GQ_PAD, N]`` (log2 units): returns p, alpha, m_new, l_new."""
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(sc - m_use[:, None])
    return p, alpha, m_new, den * alpha + tl.sum(p, axis=1)


@triton.jit
def _token_params(params_ptr, word_off, t, ok):
    """Per-token ``(scale, lo)`` as fp32 ``[NB, P]`` each, from fp16 pairs ``[.., P, 1, 2]``.

    Each pair is read as one 32-bit word (``word_off [NB]`` in words, ``t [P]``): contiguous 4-byte
    elements, which Triton's pipeliner prefetches with ``cp.async`` a stage ahead. Two 2-byte loads per
    token (scale, then lo) are not prefetched; on the H200 their latency was the largest stall (Nsight
    Compute, benchmarks/NOTES-kernels.md). Little-endian: the scale is the low half.
    """
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word_off[:, None] + t[None, :], mask=ok[:, None], other=0)
    scale = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    lo = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, lo


@triton.jit
def _slot_row(params_ptr, word_off, ok, Q4: tl.constexpr):
    """``Q4`` consecutive fp16 channel parameters per page slot as fp32 ``[NB, 1, Q4]``.

    Read as ``Q4 / 2`` 32-bit words from ``word_off [NB]`` (in words; ``ok [NB]`` masks empty slots) and
    split into the even (low half) and odd (high half) channels, for the same reason as
    :func:`_token_params`: 2-byte loads are neither vectorised nor prefetched.
    """
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word_off[:, None] + tl.arange(0, Q4 // 2)[None, :],
                mask=ok[:, None], other=0)
    even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(tl.join(even, odd), (even.shape[0], Q4))[:, None, :]


@triton.jit
def _field_cols(c4, J: tl.constexpr, G: tl.constexpr, Q4: tl.constexpr):
    """Row elements that field ``J`` of code bytes ``c4 [Q4]`` holds (``layout.py`` packing): byte ``c`` of
    group ``c // (G/4)`` carries element ``J * G/4 + c mod G/4`` of that group; ``J * Q4 + c4`` when ``G == D``."""
    G4: tl.constexpr = G // 4
    if G4 == Q4:
        return J * Q4 + c4
    else:
        return (c4 // G4) * G + J * G4 + c4 % G4


@triton.jit
def _per_group(x, NB: tl.constexpr, NG: tl.constexpr, G4: tl.constexpr, GQ_PAD: tl.constexpr):
    """Query quarter ``x [GQ_PAD, NG * G4]`` -> the B operand ``[NB * NG, G4, GQ_PAD]`` of every (slot, group)."""
    xg = tl.permute(tl.reshape(x, (GQ_PAD, NG, G4)), (1, 2, 0))  # [NG, G4, GQ_PAD]
    return tl.reshape(tl.broadcast_to(xg[None, :, :, :], (NB, NG, G4, GQ_PAD)), (NB * NG, G4, GQ_PAD))


@triton.jit
def _per_slot(x, NB: tl.constexpr, NG: tl.constexpr):
    """``x [NB, N]`` (one row per page slot) repeated for the slot's NG groups: ``[NB * NG, N]``."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], (NB, NG, x.shape[1])), (NB * NG, x.shape[1]))


@triton.jit
def _per_slot3(x, NB: tl.constexpr, NG: tl.constexpr):
    """``x [NB, M, N]`` repeated for the slot's NG groups: ``[NB * NG, M, N]``."""
    return tl.reshape(tl.broadcast_to(x[:, None, :, :], (NB, NG, x.shape[1], x.shape[2])),
                      (NB * NG, x.shape[1], x.shape[2]))


@triton.jit
def _slot_cols(params_ptr, word_off, ok, cols):
    """fp16 channel parameters per page slot as fp32 ``[NB, 1, 2 * len(cols)]``: the pairs of 32-bit words
    ``word_off [NB] + cols`` split into even (low half) and odd (high half) channels (:func:`_slot_row` for the
    non-contiguous channels of a field when ``G < D``)."""
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word_off[:, None] + cols[None, :], mask=ok[:, None], other=0)
    even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(tl.join(even, odd), (even.shape[0], 2 * cols.shape[0]))[:, None, :]


@triton.jit
def _group_params(params_ptr, word, ok):
    """fp16 ``(scale, lo)`` pairs as fp32, read as one 32-bit word each at ``word`` (any shape, in words;
    ``ok`` broadcastable mask): :func:`_token_params` for rows of several groups."""
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word, mask=ok, other=0)
    scale = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    lo = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, lo


@triton.jit
def _grouped_pages(
    q0, q1, q2, q3, k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
    block_table_ptr, num_pages_ptr, b, h, s, max_pages, pages_per_split,
    H_KV: tl.constexpr, GQ_PAD: tl.constexpr, D: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_CODEBOOK: tl.constexpr, V_CODEBOOK: tl.constexpr, FAST_UNPACK: tl.constexpr,
    NB: tl.constexpr, KEY_BITS: tl.constexpr = 2,
):
    """The INT2 pages of split ``s`` when a row holds ``NG = D // G > 1`` token groups (values, and keys unless
    ``K_CHANNEL``: then keys are scored as in the ``G == D`` path, one dot over all ``D/4`` bytes per field with
    the query scaled by the page's channel scales gathered at :func:`_field_cols`).

    The ``NB`` page slots and the row's ``NG`` groups share the batch axis of the 3-D dots (``NB * NG``): each
    (slot, group) scores its ``G/4`` code bytes per field with its own ``(scale, lo)``
    (``q·k̂ = Σ_g s_g (q_g·lev[c_g]) + lo_g Σ q_g``), the groups' scores are summed per slot before the
    softmax, and the value accumulators keep one ``[GQ_PAD, G/4]`` block per (slot, group). Quarter ``j`` of
    the query ``q_j [GQ_PAD, Q4]`` holds the elements :func:`_field_cols` ``(c, j)``, so column ``g·G/4 + c'``
    is group ``g``, byte ``c'``. Returns ``m, den [GQ_PAD]``, the four output quarters ``[GQ_PAD, Q4]`` (levels
    unscaled) and the value lows ``[GQ_PAD, Q4]`` (per group, spread over its columns), like the ``G == D`` path.
    ``KEY_BITS == 4``: key rows of ``D/2`` bytes, quarters 0 | 2 in bytes ``g G/2 + c'``, 1 | 3 in ``g G/2 + G/4 + c'``.
    """
    Q4: tl.constexpr = D // 4
    G4: tl.constexpr = G // 4
    KR: tl.constexpr = D * KEY_BITS // 8  # key code bytes per row
    NG: tl.constexpr = D // G
    NBG: tl.constexpr = NB * NG
    kl0 = tl.load(k_levels_ptr + h * 4 + 0)
    kl1 = tl.load(k_levels_ptr + h * 4 + 1)
    kl2 = tl.load(k_levels_ptr + h * 4 + 2)
    kl3 = tl.load(k_levels_ptr + h * 4 + 3)
    vl0 = tl.load(v_levels_ptr + h * 4 + 0)
    vl1 = tl.load(v_levels_ptr + h * 4 + 1)
    vl2 = tl.load(v_levels_ptr + h * 4 + 2)
    vl3 = tl.load(v_levels_ptr + h * 4 + 3)
    f0 = q0.to(tl.float32)
    f1 = q1.to(tl.float32)
    f2 = q2.to(tl.float32)
    f3 = q3.to(tl.float32)
    # Σ q over each group, the same for every slot: [NBG, GQ_PAD]
    qsum = tl.trans(tl.sum(tl.reshape(f0 + f1 + f2 + f3, (GQ_PAD, NG, G4)), axis=2))  # [NG, GQ_PAD]
    qsum = tl.reshape(tl.broadcast_to(qsum[None, :, :], (NB, NG, GQ_PAD)), (NBG, GQ_PAD))
    # uniform codes arrive as c·4^j·2^-24 (_field_scaled): the same powers of two as the G == D path
    if KEY_BITS == 4:  # nibbles arrive as c·16^n·2^-24 (_nibble_scaled): quarters 2, 3 are high nibbles
        KU = 16777216.0
        qt0 = _per_group(f0, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt1 = _per_group(f1, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt2 = _per_group(f2 * 0.0625, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt3 = _per_group(f3 * 0.0625, NB, NG, G4, GQ_PAD).to(tl.float16)
    elif K_CODEBOOK:
        KU = 1.0
        qt0 = _per_group(f0, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt1 = _per_group(f1, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt2 = _per_group(f2, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt3 = _per_group(f3, NB, NG, G4, GQ_PAD).to(tl.float16)
    else:
        KU = 16777216.0
        qt0 = _per_group(f0, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt1 = _per_group(f1 * 0.25, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt2 = _per_group(f2 * 0.0625, NB, NG, G4, GQ_PAD).to(tl.float16)
        qt3 = _per_group(f3 * 0.015625, NB, NG, G4, GQ_PAD).to(tl.float16)
    if V_CODEBOOK:
        VU0 = 1.0
        VU1 = 1.0
        VU2 = 1.0
        VU3 = 1.0
    else:
        VU0 = 16777216.0
        VU1 = 4194304.0
        VU2 = 1048576.0
        VU3 = 262144.0
    nb = tl.arange(0, NB)
    gi = tl.arange(0, NG)
    t = tl.arange(0, P)
    cg = tl.arange(0, G4)
    c4 = tl.arange(0, Q4)
    ktile = (t[:, None] * Q4 + c4[None, :])[None, :, :]  # [1, P, Q4]: a page's key codes (channel keys)
    # channel keys: quarter j of the query times the page's channel scales, [NB, GQ_PAD, Q4] (4^-j folded in as
    # for the token scores); w_j the 32-bit words of the channel pairs (e_j(2m), e_j(2m) + 1), m < Q4 / 2
    if KEY_BITS == 4:  # quarters 2, 3 meet high nibbles (16^-1 folded in)
        qc0 = tl.broadcast_to(f0[None, :, :], (NB, GQ_PAD, Q4))
        qc1 = tl.broadcast_to(f1[None, :, :], (NB, GQ_PAD, Q4))
        qc2 = tl.broadcast_to(f2[None, :, :] * 0.0625, (NB, GQ_PAD, Q4))
        qc3 = tl.broadcast_to(f3[None, :, :] * 0.0625, (NB, GQ_PAD, Q4))
        # 4-bit key bytes of column c4 (quarters 0 | 2; + G4: quarters 1 | 3), channel keys: [1, P, Q4]
        ktile4 = (t[:, None] * KR + (c4 // G4)[None, :] * (G // 2) + (c4 % G4)[None, :])[None, :, :]
        # token keys: the bytes of (group g, position c') [1, NG, P, G4]
        tile4 = (gi[:, None, None] * (G // 2) + t[None, :, None] * KR + cg[None, None, :])[None, :, :, :]
    else:
        kf: tl.constexpr = 1.0 if K_CODEBOOK else 0.25
        qc0 = tl.broadcast_to(f0[None, :, :], (NB, GQ_PAD, Q4))
        qc1 = tl.broadcast_to(f1[None, :, :] * kf, (NB, GQ_PAD, Q4))
        qc2 = tl.broadcast_to(f2[None, :, :] * (kf * kf), (NB, GQ_PAD, Q4))
        qc3 = tl.broadcast_to(f3[None, :, :] * (kf * kf * kf), (NB, GQ_PAD, Q4))
    m2 = 2 * tl.arange(0, Q4 // 2)
    w0 = _field_cols(m2, 0, G, Q4) // 2
    w1 = _field_cols(m2, 1, G, Q4) // 2
    w2 = _field_cols(m2, 2, G, Q4) // 2
    w3 = _field_cols(m2, 3, G, Q4) // 2
    tile = (gi[:, None, None] * G4 + t[None, :, None] * Q4 + cg[None, None, :])[None, :, :, :]  # [1, NG, P, G4]
    wtile = (t[None, :] * NG + gi[:, None])[None, :, :]  # [1, NG, P]: (scale, lo) words of token t, group g
    bm = tl.full([NB, GQ_PAD], float("-inf"), tl.float32)
    bl = tl.zeros([NB, GQ_PAD], tl.float32)
    b0 = tl.zeros([NBG, GQ_PAD, G4], tl.float32)
    b1 = tl.zeros([NBG, GQ_PAD, G4], tl.float32)
    b2 = tl.zeros([NBG, GQ_PAD, G4], tl.float32)
    b3 = tl.zeros([NBG, GQ_PAD, G4], tl.float32)
    blo = tl.zeros([NBG, GQ_PAD], tl.float32)
    start = s * pages_per_split
    end = tl.minimum(start + pages_per_split, tl.load(num_pages_ptr + b))
    for p0 in range(start, end, NB):
        slot = p0 + nb
        ok = slot < end
        page = tl.load(block_table_ptr + b.to(tl.int64) * max_pages + slot, mask=ok, other=0).to(tl.int64)
        ph = page * H_KV + h
        code_off = tl.multiple_of(ph * (P * Q4), 16)
        word_off = tl.multiple_of(ph * (P * NG), 16)
        ok4 = ok[:, None, None, None]
        vc = tl.reshape(tl.load(v_codes_ptr + code_off[:, None, None, None] + tile, mask=ok4, other=0), (NBG, P, G4))
        if K_CHANNEL:  # [2, D] fp16 per page-head (scales row, lows row) = D words
            if KEY_BITS == 4:
                koff = tl.multiple_of(ph * (P * KR), 16)
                ka = tl.load(k_codes_ptr + koff[:, None, None] + ktile4, mask=ok[:, None, None], other=0)
                kb = tl.load(k_codes_ptr + koff[:, None, None] + ktile4 + G4, mask=ok[:, None, None], other=0)
            else:
                # [NB, P, Q4]
                kc = tl.load(k_codes_ptr + code_off[:, None, None] + ktile, mask=ok[:, None, None], other=0)
            kw = ph * D
            ks0 = _slot_cols(k_params_ptr, kw, ok, w0)
            ks1 = _slot_cols(k_params_ptr, kw, ok, w1)
            ks2 = _slot_cols(k_params_ptr, kw, ok, w2)
            ks3 = _slot_cols(k_params_ptr, kw, ok, w3)
            qlo = f0[None, :, :] * _slot_cols(k_params_ptr, kw + D // 2, ok, w0)
            qlo += f1[None, :, :] * _slot_cols(k_params_ptr, kw + D // 2, ok, w1)
            qlo += f2[None, :, :] * _slot_cols(k_params_ptr, kw + D // 2, ok, w2)
            qlo += f3[None, :, :] * _slot_cols(k_params_ptr, kw + D // 2, ok, w3)
            const = tl.sum(qlo, axis=2)  # [NB, GQ_PAD]
            if KEY_BITS == 4:
                st_ = tl.dot(_nibble_scaled(ka, 0, FAST_UNPACK), tl.permute((qc0 * ks0).to(tl.float16), (0, 2, 1)))
                st_ = tl.dot(_nibble_scaled(kb, 0, FAST_UNPACK), tl.permute((qc1 * ks1).to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(_nibble_scaled(ka, 1, FAST_UNPACK), tl.permute((qc2 * ks2).to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(_nibble_scaled(kb, 1, FAST_UNPACK), tl.permute((qc3 * ks3).to(tl.float16), (0, 2, 1)), st_)
            else:
                st_ = tl.dot(_field_scaled(kc, 0, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute((qc0 * ks0).to(tl.float16), (0, 2, 1)))
                st_ = tl.dot(_field_scaled(kc, 1, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute((qc1 * ks1).to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(_field_scaled(kc, 2, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute((qc2 * ks2).to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(_field_scaled(kc, 3, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute((qc3 * ks3).to(tl.float16), (0, 2, 1)), st_)
            st_ = st_ * KU + const[:, None, :]
        else:
            if KEY_BITS == 4:
                koff = tl.multiple_of(ph * (P * KR), 16)
                ka = tl.reshape(tl.load(k_codes_ptr + koff[:, None, None, None] + tile4, mask=ok4, other=0),
                                (NBG, P, G4))
                kb = tl.reshape(tl.load(k_codes_ptr + koff[:, None, None, None] + tile4 + G4, mask=ok4, other=0),
                                (NBG, P, G4))
            else:
                ka = tl.reshape(tl.load(k_codes_ptr + code_off[:, None, None, None] + tile, mask=ok4, other=0),
                                (NBG, P, G4))
                kb = ka  # unread by _key_scores' 2-bit path
            ks, klo = _group_params(k_params_ptr, word_off[:, None, None] + wtile, ok[:, None, None])  # [NB, NG, P]
            ks = tl.reshape(ks, (NBG, P))
            klo = tl.reshape(klo, (NBG, P))
            # scores transposed per (slot, group): [NBG, P, GQ_PAD], summed over the groups of each slot
            st_ = _key_scores(ka, kb, qt0, qt1, qt2, qt3, kl0, kl1, kl2, kl3, KEY_BITS, K_CODEBOOK, FAST_UNPACK)
            st_ = st_ * (ks * KU)[:, :, None] + klo[:, :, None] * qsum[:, None, :]
            st_ = tl.sum(tl.reshape(st_, (NB, NG, P, GQ_PAD)), axis=1)  # [NB, P, GQ_PAD]
        st_ = tl.where(ok[:, None, None], st_, float("-inf"))
        m_new = tl.maximum(bm, tl.max(st_, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(bm - m_use)
        pt = tl.exp2(st_ - m_use[:, None, :])
        bl = bl * alpha + tl.sum(pt, axis=1)
        bm = m_new
        vs, vlo = _group_params(v_params_ptr, word_off[:, None, None] + wtile, ok[:, None, None])
        vs = tl.reshape(vs, (NBG, P))
        vlo = tl.reshape(vlo, (NBG, P))
        ptg = _per_slot3(pt, NB, NG)  # [NBG, P, GQ_PAD]
        ag2 = _per_slot(alpha, NB, NG)  # [NBG, GQ_PAD]
        ag = ag2[:, :, None]
        ps = tl.permute((ptg * vs[:, :, None]).to(tl.float16), (0, 2, 1))
        b0 = tl.dot(ps, _field_scaled(vc, 0, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b0 * ag)
        b1 = tl.dot(ps, _field_scaled(vc, 1, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b1 * ag)
        b2 = tl.dot(ps, _field_scaled(vc, 2, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b2 * ag)
        b3 = tl.dot(ps, _field_scaled(vc, 3, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b3 * ag)
        blo = blo * ag2 + tl.sum(ptg * vlo[:, :, None], axis=1)
    # ---- combine the page slots by their log-sum-exp; groups back to columns g·G/4 + c' ----------------------
    m = tl.max(bm, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(bm - m_use[None, :])  # [NB, GQ_PAD]; empty slots weigh 0
    den = tl.sum(bl * w, axis=0)
    wg = _per_slot(w, NB, NG)  # [NBG, GQ_PAD]
    acc0 = _columns(b0 * wg[:, :, None], NB, NG, GQ_PAD, G4) * VU0
    acc1 = _columns(b1 * wg[:, :, None], NB, NG, GQ_PAD, G4) * VU1
    acc2 = _columns(b2 * wg[:, :, None], NB, NG, GQ_PAD, G4) * VU2
    acc3 = _columns(b3 * wg[:, :, None], NB, NG, GQ_PAD, G4) * VU3
    lo = tl.trans(tl.sum(tl.reshape(blo * wg, (NB, NG, GQ_PAD)), axis=0))  # [GQ_PAD, NG]
    acclo = tl.reshape(tl.broadcast_to(lo[:, :, None], (GQ_PAD, NG, G4)), (GQ_PAD, NG * G4))
    return m, den, acc0, acc1, acc2, acc3, acclo


@triton.jit
def _columns(x, NB: tl.constexpr, NG: tl.constexpr, GQ_PAD: tl.constexpr, G4: tl.constexpr):
    """``[NB * NG, GQ_PAD, G4]`` per (slot, group) -> summed over the slots, ``[GQ_PAD, NG * G4]``."""
    y = tl.sum(tl.reshape(x, (NB, NG, GQ_PAD, G4)), axis=0)  # [NG, GQ_PAD, G4]
    return tl.reshape(tl.permute(y, (1, 0, 2)), (GQ_PAD, NG * G4))


@triton.jit
def window_block(sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
                 b, h, c, tb, H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, S0: tl.constexpr,
                 RC: tl.constexpr, BN: tl.constexpr):
    """BF16 chunk ``c`` of sequence ``b``, KV head ``h``: chunks ``c < cdiv(S0, BN)`` are the sink's, the others
    the recent ring's. Returns the K and V base pointers of the chunk's ``BN`` rows (bf16, row ``t`` at
    ``base + t * D``) and the mask ``[BN]`` of its tokens (``tb = tl.arange(0, BN)``) that hold a cached token.

    The split kernels of this backend and of the hopper one (``kernels/decode/hopper_kernel.py``, a Gluon kernel
    calling it on its own layouts) read their BF16 windows through this one helper.
    """
    NSINK: tl.constexpr = (S0 + BN - 1) // BN
    if c < NSINK:
        kv_off = (b * H_KV + h).to(tl.int64) * (S0 * D) + c * (BN * D)
        kb = sink_k_ptr + kv_off
        vb = sink_v_ptr + kv_off
        tmask = tb < tl.minimum(tl.load(sink_len_ptr + b), S0) - c * BN
    else:
        kv_off = (b * H_KV + h).to(tl.int64) * (RC * D) + (c - NSINK) * (BN * D)
        kb = recent_k_ptr + kv_off
        vb = recent_v_ptr + kv_off
        # the recent ring (layout.py): slots (start + j) mod RC, j < recent_len, start = (num_pages * P) mod RC
        slot = (c - NSINK) * BN + tb
        start = (tl.load(num_pages_ptr + b) * P) % RC
        tmask = (slot < RC) & ((slot - start + RC) % RC < tl.load(recent_len_ptr + b))
    return kb, vb, tmask


hash_bottom_up(globals())  # one Triton cache key per helper, whatever kernel launches first (cache_keys.py)

__all__ = ["window_block"]
