"""Triton helpers for the ``mma16`` page packing (``reference.pack_mma16`` is the definition).

``store_mma16`` writes a tile of codes into a page in fragment order; ``repack_linear_to_mma16`` turns a page-head
written in linear order into mma16 order in place. Both address the page as little-endian 32-bit words. 2-bit codes:
word ``((mo * 32 + lane) * MB + mi) * (C // 32) + w`` holds the 16 codes of rows ``16 * (MB * mo + mi) + 8 * hr + g``
and columns ``32 * w + 16 * kb + 8 * hc + 2 * tq + e`` (``lane = 4 * g + tq``) at bits ``2 * (8e + 4kb + 2hc +
hr)``. 4-bit codes: word ``((mo * 32 + lane) * MB + mi) * (C // 16) + w`` holds the 8 codes of the same rows and
columns ``16 * w + 8 * hc + 2 * tq + e`` at bits ``4 * (4e + 2hc + hr)``. The tile is handled as a view
``(mo, mi, hr, g, w, [kb,] hc, tq, e)`` of its ``[RT, CT]`` codes, which is its natural row-major order, so no
permutation is needed: the word of each element is an index sum.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ax9(n: tl.constexpr, axis: tl.constexpr):
    """``arange(0, n)`` placed on axis ``axis`` of a 9-D shape (size 1 elsewhere)."""
    a = tl.arange(0, n)
    if axis == 0:
        return a[:, None, None, None, None, None, None, None, None]
    elif axis == 1:
        return a[None, :, None, None, None, None, None, None, None]
    elif axis == 2:
        return a[None, None, :, None, None, None, None, None, None]
    elif axis == 3:
        return a[None, None, None, :, None, None, None, None, None]
    elif axis == 4:
        return a[None, None, None, None, :, None, None, None, None]
    elif axis == 5:
        return a[None, None, None, None, None, :, None, None, None]
    elif axis == 6:
        return a[None, None, None, None, None, None, :, None, None]
    elif axis == 7:
        return a[None, None, None, None, None, None, None, :, None]
    else:
        return a[None, None, None, None, None, None, None, None, :]


@triton.jit
def _ax5(n: tl.constexpr, axis: tl.constexpr):
    """``arange(0, n)`` on axis ``axis`` of a 5-D shape."""
    a = tl.arange(0, n)
    if axis == 0:
        return a[:, None, None, None, None]
    elif axis == 1:
        return a[None, :, None, None, None]
    elif axis == 2:
        return a[None, None, :, None, None]
    elif axis == 3:
        return a[None, None, None, :, None]
    else:
        return a[None, None, None, None, :]


@triton.jit
def _ax8(n: tl.constexpr, axis: tl.constexpr):
    """``arange(0, n)`` placed on axis ``axis`` of an 8-D shape (size 1 elsewhere)."""
    a = tl.arange(0, n)
    if axis == 0:
        return a[:, None, None, None, None, None, None, None]
    elif axis == 1:
        return a[None, :, None, None, None, None, None, None]
    elif axis == 2:
        return a[None, None, :, None, None, None, None, None]
    elif axis == 3:
        return a[None, None, None, :, None, None, None, None]
    elif axis == 4:
        return a[None, None, None, None, :, None, None, None]
    elif axis == 5:
        return a[None, None, None, None, None, :, None, None]
    elif axis == 6:
        return a[None, None, None, None, None, None, :, None]
    else:
        return a[None, None, None, None, None, None, None, :]


@triton.jit
def store_mma16(page_ptr, codes, r0, c0, R: tl.constexpr, C: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr,
                MB: tl.constexpr, BITS: tl.constexpr = 2):
    """Store the codes ``codes [RT, CT]`` (int32 in ``0 .. 2**BITS - 1``) as rows ``r0 ..`` and columns ``c0 ..`` of
    the ``[R, C]`` mma16 matrix of one page at ``page_ptr`` (uint8, 4-byte aligned). ``MB =
    reference.mma16_group(R, C, BITS)``; ``r0`` and ``RT`` multiples of ``16 * MB``, ``c0`` and ``CT`` multiples of
    ``64 // BITS`` (the columns of a word)."""
    MO: tl.constexpr = RT // (16 * MB)
    if BITS == 4:
        W: tl.constexpr = CT // 16
        x = tl.reshape(codes.to(tl.uint32), (MO, MB, 2, 8, W, 2, 4, 2))  # (mo, mi, hr, g, w, hc, tq, e)
        shift = 4 * (_ax8(2, 2) + 2 * _ax8(2, 5) + 4 * _ax8(2, 7))
        x = x << shift.to(tl.uint32)
        words = tl.sum(tl.sum(tl.sum(x, axis=7), axis=5), axis=2)  # (mo, mi, g, w, tq)
        idx0 = c0 // 16
        WC: tl.constexpr = C // 16
    else:
        W: tl.constexpr = CT // 32
        x = tl.reshape(codes.to(tl.uint32), (MO, MB, 2, 8, W, 2, 2, 4, 2))  # (mo, mi, hr, g, w, kb, hc, tq, e)
        shift = 2 * (_ax9(2, 2) + 2 * _ax9(2, 6) + 4 * _ax9(2, 5) + 8 * _ax9(2, 8))
        x = x << shift.to(tl.uint32)
        words = tl.sum(tl.sum(tl.sum(tl.sum(x, axis=8), axis=6), axis=5), axis=2)  # (mo, mi, g, w, tq)
        idx0 = c0 // 32
        WC: tl.constexpr = C // 32
    mo = _ax5(MO, 0) + r0 // (16 * MB)
    idx = (((mo * 32 + 4 * _ax5(8, 2) + _ax5(4, 4)) * MB + _ax5(MB, 1)) * WC + idx0 + _ax5(W, 3))
    tl.store(page_ptr.to(tl.pointer_type(tl.uint32)) + idx, words)


@triton.jit
def _ax4(n: tl.constexpr, axis: tl.constexpr):
    """``arange(0, n)`` on axis ``axis`` of a 4-D shape."""
    a = tl.arange(0, n)
    if axis == 0:
        return a[:, None, None, None]
    elif axis == 1:
        return a[None, :, None, None]
    elif axis == 2:
        return a[None, None, :, None]
    else:
        return a[None, None, None, :]


@triton.jit
def repack_linear_to_mma16(page_ptr, P: tl.constexpr, D: tl.constexpr, VALUES: tl.constexpr, G: tl.constexpr = 0,
                           BITS: tl.constexpr = 2):
    """Rewrite one page-head's codes, written in linear order (``[P, D * BITS / 8]`` bytes, ``reference.pack_codes``
    with groups of ``G``, ``G = 0``: one group per row: byte ``b`` of a group of token ``t`` holds its elements ``b +
    j G / c`` at bits ``j * BITS``, ``c = 8 / BITS``), in mma16 order (``reference.pack_mma16``), in place: keys as the
    ``[P, D]`` matrix (``VALUES`` False), values as ``[D, P]``.

    Every word ``(rb, g, tq, w)`` of the result is built in one thread from its codes, each read from a byte of the
    linear page (the same bytes serve several words: L1 hits) and moved into place with shifts: no exchange between
    threads. All reads happen before the barrier, all writes after it, so the page can be rewritten in place.
    """
    R: tl.constexpr = D if VALUES else P
    C: tl.constexpr = P if VALUES else D
    GS: tl.constexpr = D if G == 0 else G
    CPB: tl.constexpr = 8 // BITS  # codes per byte
    QG: tl.constexpr = GS // CPB  # bytes per group
    MASK: tl.constexpr = (1 << BITS) - 1
    MB0: tl.constexpr = 256 // (C * BITS) if C * BITS < 256 else 1
    MB: tl.constexpr = MB0 if (R // 16) % MB0 == 0 else 1
    CW: tl.constexpr = 64 // BITS  # columns of a word
    W: tl.constexpr = C // CW
    NF: tl.constexpr = 32 // BITS  # codes of a word
    rb = _ax4(R // 16, 0)
    g = _ax4(8, 1)
    tq = _ax4(4, 2)
    w = _ax4(W, 3)
    word = tl.zeros((R // 16, 8, 4, W), tl.uint32)
    for f in range(NF):  # 2-bit: f = e * 8 + kb * 4 + hc * 2 + hr; 4-bit: f = e * 4 + hc * 2 + hr (a loop, not
        # unrolled: the unrolled reads made Triton's coalescing pass most of the append kernel's compile)
        hr = f % 2
        hc = (f // 2) % 2
        if BITS == 4:
            kb = 0
            e = f // 4
        else:
            kb = (f // 4) % 2
            e = f // 8
        row = 16 * rb + 8 * hr + g  # of the mma16 matrix
        col = CW * w + 16 * kb + 8 * hc + 2 * tq + e
        if VALUES:
            tok = col
            dim = row
        else:
            tok = row
            dim = col
        j = dim % GS
        byte = tl.load(page_ptr + tok * (D // CPB) + (dim // GS) * QG + j % QG).to(tl.uint32)
        word |= ((byte >> (BITS * (j // QG)).to(tl.uint32)) & MASK) << tl.cast(BITS * f, tl.uint32)
    tl.debug_barrier()  # every read of the linear page is done before it is overwritten
    idx = (((rb // MB) * 32 + 4 * g + tq) * MB + rb % MB) * W + w
    tl.store(page_ptr.to(tl.pointer_type(tl.uint32)) + idx, word)
