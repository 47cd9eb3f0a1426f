"""Triton helpers for the ``mma16`` page packing (``reference.pack_mma16`` is the definition).

``store_mma16`` writes a tile of 2-bit codes into a page in fragment order; ``load_mma16`` reads a tile
back as codes in logical ``[rows, cols]`` order; ``repack_linear_to_mma16`` turns a page-head written in linear
order (one group per row) into mma16 order in place. Both address the page as little-endian 32-bit words: word
``((mo * 32 + lane) * MB + mi) * (C // 32) + w`` holds the 16 codes of rows ``16 * (MB * mo + mi) + 8 * hr + g``
and columns ``32 * w + 16 * kb + 8 * hc + 2 * tq + e`` (``lane = 4 * g + tq``) at bits ``2 * (8e + 4kb + 2hc +
hr)``. The tile is handled as a 9-D view ``(mo, mi, hr, g, w, kb, hc, tq, e)`` of its ``[RT, CT]`` codes, which
is its natural row-major order, so no permutation is needed: the word of each element is an index sum.
"""

from __future__ import annotations

import triton
import triton.language as tl


def mma16_group(rows: int, cols: int) -> int:
    """``MB`` of ``reference.mma16_group`` (restated for constexpr use; the tests check both agree)."""
    mb = 128 // cols if cols < 128 else 1
    return mb if (rows // 16) % mb == 0 else 1


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
def store_mma16(page_ptr, codes, r0, c0, R: tl.constexpr, C: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr,
                MB: tl.constexpr):
    """Store the codes ``codes [RT, CT]`` (int32 in 0..3) as rows ``r0 ..`` and columns ``c0 ..`` of the
    ``[R, C]`` mma16 matrix of one page at ``page_ptr`` (uint8, 4-byte aligned). ``MB = mma16_group(R, C)``;
    ``r0`` and ``RT`` multiples of ``16 * MB``, ``c0`` and ``CT`` multiples of 32."""
    MO: tl.constexpr = RT // (16 * MB)
    W: tl.constexpr = CT // 32
    x = tl.reshape(codes.to(tl.uint32), (MO, MB, 2, 8, W, 2, 2, 4, 2))
    shift = 2 * (_ax9(2, 2) + 2 * _ax9(2, 6) + 4 * _ax9(2, 5) + 8 * _ax9(2, 8))
    x = x << shift.to(tl.uint32)
    words = tl.sum(tl.sum(tl.sum(tl.sum(x, axis=8), axis=6), axis=5), axis=2)  # (mo, mi, g, w, tq)
    mo = _ax5(MO, 0) + r0 // (16 * MB)
    idx = (((mo * 32 + 4 * _ax5(8, 2) + _ax5(4, 4)) * MB + _ax5(MB, 1)) * (C // 32) + c0 // 32 + _ax5(W, 3))
    tl.store(page_ptr.to(tl.pointer_type(tl.uint32)) + idx, words)


@triton.jit
def load_mma16(page_ptr, r0, c0, R: tl.constexpr, C: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr,
               MB: tl.constexpr, mask):
    """Codes of rows ``r0 ..`` and columns ``c0 ..`` of a page's ``[R, C]`` mma16 matrix as ``[RT, CT]`` int32
    (the inverse of :func:`store_mma16`; same alignment rules). ``mask``: scalar bool, False loads zeros."""
    MO: tl.constexpr = RT // (16 * MB)
    W: tl.constexpr = CT // 32
    mo = _ax5(MO, 0) + r0 // (16 * MB)
    idx = (((mo * 32 + 4 * _ax5(8, 2) + _ax5(4, 4)) * MB + _ax5(MB, 1)) * (C // 32) + c0 // 32 + _ax5(W, 3))
    words = tl.load(page_ptr.to(tl.pointer_type(tl.uint32)) + idx, mask=mask, other=0)  # (mo, mi, g, w, tq)
    shift = 2 * (_ax9(2, 2) + 2 * _ax9(2, 6) + 4 * _ax9(2, 5) + 8 * _ax9(2, 8))
    codes = (words[:, :, None, :, :, None, None, :, None] >> shift.to(tl.uint32)) & 3
    return tl.reshape(codes, (RT, CT)).to(tl.int32)


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
def repack_linear_to_mma16(page_ptr, P: tl.constexpr, D: tl.constexpr, VALUES: tl.constexpr):
    """Rewrite one page-head's 2-bit codes, written in linear order with one group per row (``[P, D // 4]`` bytes:
    byte ``b`` of token ``t`` holds dims ``b + k D/4`` at bits ``2k``), in mma16 order (``reference.pack_mma16``),
    in place: keys as the ``[P, D]`` matrix (``VALUES`` False), values as ``[D, P]``.

    Every word ``(rb, g, tq, w)`` of the result is built in one thread from its 16 codes, each read as a byte of the
    linear page (the same bytes serve several words: L1 hits) and moved into place with shifts: no exchange between
    threads. All reads happen before the barrier, all writes after it, so the page can be rewritten in place.
    """
    R: tl.constexpr = D if VALUES else P
    C: tl.constexpr = P if VALUES else D
    Q: tl.constexpr = D // 4
    MB0: tl.constexpr = 128 // C if C < 128 else 1
    MB: tl.constexpr = MB0 if (R // 16) % MB0 == 0 else 1
    W: tl.constexpr = C // 32
    rb = _ax4(R // 16, 0)
    g = _ax4(8, 1)
    tq = _ax4(4, 2)
    w = _ax4(W, 3)
    word = tl.zeros((R // 16, 8, 4, W), tl.uint32)
    for f in tl.static_range(16):  # f = e * 8 + kb * 4 + hc * 2 + hr: bits 2 (4 kb + 2 hc + hr) + 16 e
        hr = f % 2
        hc = (f // 2) % 2
        kb = (f // 4) % 2
        e = f // 8
        row = 16 * rb + 8 * hr + g  # of the mma16 matrix
        col = 32 * w + 16 * kb + 8 * hc + 2 * tq + e
        if VALUES:
            tok = col
            dim = row
        else:
            tok = row
            dim = col
        byte = tl.load(page_ptr + tok * Q + dim % Q).to(tl.uint32)
        word |= ((byte >> (2 * (dim // Q)).to(tl.uint32)) & 3) << (2 * (4 * kb + 2 * hc + hr) + 16 * e)
    tl.debug_barrier()  # every read of the linear page is done before it is overwritten
    idx = (((rb // MB) * 32 + 4 * g + tq) * MB + rb % MB) * W + w
    tl.store(page_ptr.to(tl.pointer_type(tl.uint32)) + idx, word)
