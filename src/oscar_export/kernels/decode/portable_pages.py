"""The portable split kernel's page helpers (``decode/portable.py``'s ``decode_split_kernel`` calls them; its module
doc explains the arithmetic): ``@triton.jit`` functions, inlined into the kernel.

* code fields as exact fp16 values: :func:`field_scaled` (2-bit fields, the PTX subnormal trick for uniform codes),
  :func:`nibble_scaled` (4-bit key pages), :func:`_lev` (fitted levels), and :func:`key_scores`, a page block's
  scores over the four key quarters;
* :func:`softmax_step`, the online-softmax update of a split;
* per-token and per-channel parameters read as 32-bit words (prefetched with the codes): :func:`token_params`,
  :func:`slot_row`; :func:`field_cols`, the row elements a field holds;
* :func:`window_block`, a BF16 sink / recent chunk's rows and mask, shared with the hopper kernel
  (``decode/hopper_kernel.py``).

A split's INT2 pages when a row holds several token groups (``G < D``) are ``portable_grouped.py``'s, built on these.
The names keep their underscores: they are the kernel's private pieces (imported by ``portable.py`` and
``portable_grouped.py`` only, whose kernel bodies call them by these names; ``window_block`` is public, the hopper
kernel reads it too).
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
def field_scaled(codes, J: tl.constexpr, l0, l1, l2, l3, CODEBOOK: tl.constexpr, FAST: tl.constexpr):
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
def nibble_scaled(codes, N: tl.constexpr, FAST: tl.constexpr):
    """Nibble ``N`` (0 low, 1 high) of every byte of 4-bit key codes as the exact fp16 ``c·16^N·2^-24``."""
    if FAST:
        if N == 0:
            return tl.inline_asm_elementwise(_NIB0, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_NIB1, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return ((codes & (15 << (4 * N))).to(tl.float32) * TINY).to(tl.float16)


@triton.jit
def key_scores(ka, kb, b0, b1, b2, b3, l0, l1, l2, l3, KEY_BITS: tl.constexpr, CODEBOOK: tl.constexpr,
                FAST: tl.constexpr):
    """``Σ_j K_j · b_j`` over the four key quarters of a page block: 2-bit codes ``ka`` (quarter ``j`` = field
    ``j`` of each byte, :func:`field_scaled`; ``kb`` unread), or 4-bit codes (quarters 0 | 2 the low | high
    nibbles of ``ka``, 1 | 3 those of ``kb``, :func:`nibble_scaled`). The ``b_j`` carry the folded powers of two."""
    if KEY_BITS == 4:
        acc = tl.dot(nibble_scaled(ka, 0, FAST), b0)
        acc = tl.dot(nibble_scaled(kb, 0, FAST), b1, acc)
        acc = tl.dot(nibble_scaled(ka, 1, FAST), b2, acc)
        acc = tl.dot(nibble_scaled(kb, 1, FAST), b3, acc)
    else:
        acc = tl.dot(field_scaled(ka, 0, l0, l1, l2, l3, CODEBOOK, FAST), b0)
        acc = tl.dot(field_scaled(ka, 1, l0, l1, l2, l3, CODEBOOK, FAST), b1, acc)
        acc = tl.dot(field_scaled(ka, 2, l0, l1, l2, l3, CODEBOOK, FAST), b2, acc)
        acc = tl.dot(field_scaled(ka, 3, l0, l1, l2, l3, CODEBOOK, FAST), b3, acc)
    return acc


@triton.jit
def softmax_step(sc, m, den):
    """Online-softmax update for scores ``sc [GQ_PAD, N]`` (log2 units): returns p, alpha, m_new, l_new."""
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(sc - m_use[:, None])
    return p, alpha, m_new, den * alpha + tl.sum(p, axis=1)


@triton.jit
def token_params(params_ptr, word_off, t, ok):
    """Per-token ``(scale, lo)`` as fp32 ``[NB, P]`` each, from fp16 pairs ``[.., P, 1, 2]``.

    Each pair is read as one 32-bit word (``word_off [NB]`` in words, ``t [P]``): contiguous 4-byte
    elements, which Triton's pipeliner prefetches with ``cp.async`` a stage ahead. Two 2-byte loads per
    token (scale, then lo) are not prefetched; on the H200 their latency was the largest stall (Nsight
    Compute). Little-endian: the scale is the low half.
    """
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word_off[:, None] + t[None, :], mask=ok[:, None], other=0)
    scale = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    lo = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, lo


@triton.jit
def slot_row(params_ptr, word_off, ok, Q4: tl.constexpr):
    """``Q4`` consecutive fp16 channel parameters per page slot as fp32 ``[NB, 1, Q4]``.

    Read as ``Q4 / 2`` 32-bit words from ``word_off [NB]`` (in words; ``ok [NB]`` masks empty slots) and
    split into the even (low half) and odd (high half) channels, for the same reason as
    :func:`token_params`: 2-byte loads are neither vectorised nor prefetched.
    """
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word_off[:, None] + tl.arange(0, Q4 // 2)[None, :],
                mask=ok[:, None], other=0)
    even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(tl.join(even, odd), (even.shape[0], Q4))[:, None, :]


@triton.jit
def field_cols(c4, J: tl.constexpr, G: tl.constexpr, Q4: tl.constexpr):
    """Row elements that field ``J`` of code bytes ``c4 [Q4]`` holds (``layout.py`` packing): byte ``c`` of
    group ``c // (G/4)`` carries element ``J * G/4 + c mod G/4`` of that group; ``J * Q4 + c4`` when ``G == D``."""
    G4: tl.constexpr = G // 4
    if G4 == Q4:
        return J * Q4 + c4
    else:
        return (c4 // G4) * G + J * G4 + c4 % G4


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

__all__ = [
    "field_cols", "field_scaled", "key_scores", "nibble_scaled", "slot_row", "softmax_step", "token_params",
    "window_block"
]
