"""The hopper decode kernel's page operands: a page's mma16 codes as the register A operand of ``wgmma``, in Gluon.

The codes are loaded as uint16 halves in the layout where thread ``lane`` of warp ``w`` holds the words of row
blocks ``w, w + 4, ...`` (``reference.pack_mma16``; :func:`word_offsets`, :func:`word_offsets4` for 4-bit key
pages); each field of a word becomes one ``half2`` register by one ``and.b32`` (:func:`_and_field`,
:func:`_and_nibble`; the upper fields after one ``shr.b32``, :func:`_shr8`), read as the exact fp16 subnormal
``c·4^(2hc + hr)·2^-24`` (4-bit: ``c·16^hr·2^-24``). :func:`a_operand` / :func:`a_operand4` rebuild the logical
``[R, C]`` tile with joins, one permute and one reshape, and ``convert_layout(..., assert_trivial=True)`` makes the
compiler prove that this *is* the wgmma A layout. Used by :mod:`.hopper_kernel` (its module doc: where the powers of
two go); its PyTorch twin, step by step: ``hopper_emulation.emulate_a_operand``. Gluon has no interpreter: the
compiler's proof is tested by compiling for sm_90 on the CPU (tests/kernels/test_decode_hopper_kernel.py,
test_decode_hopper_operands.py).
"""

from __future__ import annotations

from .gluon_names import HAVE_GLUON, gl, gluon  # the Gluon API as this Triton spells it

if HAVE_GLUON:

    @gluon.jit
    def _and_field(x, J: gl.constexpr):
        """``x & (0x00030003 << 2J)`` on packed uint16 pairs, read as fp16x2 (one ``and.b32`` per two codes)."""
        if J == 0:
            return gl.inline_asm_elementwise("and.b32 $0, $1, 0x00030003;", "=r,r", [x], dtype=gl.float16,
                                             is_pure=True, pack=2)
        elif J == 1:
            return gl.inline_asm_elementwise("and.b32 $0, $1, 0x000C000C;", "=r,r", [x], dtype=gl.float16,
                                             is_pure=True, pack=2)
        elif J == 2:
            return gl.inline_asm_elementwise("and.b32 $0, $1, 0x00300030;", "=r,r", [x], dtype=gl.float16,
                                             is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise("and.b32 $0, $1, 0x00C000C0;", "=r,r", [x], dtype=gl.float16,
                                             is_pure=True, pack=2)

    @gluon.jit
    def _shr8(x):
        """``x >> 8`` per uint16 half of packed pairs (one ``shr.b32``: the high half's low byte lands in bits
        8..15 of the low half, which every field mask clears)."""
        return gl.inline_asm_elementwise("shr.b32 $0, $1, 8;", "=r,r", [x], dtype=gl.uint16, is_pure=True, pack=2)

    @gluon.jit
    def word_offsets(R: gl.constexpr, C: gl.constexpr, C0: gl.constexpr, CT: gl.constexpr, LW: gl.constexpr):
        """uint16 offsets ``[R // 16 * 32, CT // 16]`` of columns ``C0 .. C0 + CT`` of a page's ``[R, C]`` mma16
        matrix: row ``rb * 32 + lane`` (row block ``rb``), column ``2 * w + e`` (word ``C0 // 32 + w``, half
        ``e``). ``MB`` = ``reference.mma16_group(R, C)``."""
        MB0: gl.constexpr = 128 // C if C < 128 else 1
        MB: gl.constexpr = MB0 if (R // 16) % MB0 == 0 else 1
        t = gl.arange(0, R // 16 * 32, layout=gl.SliceLayout(1, LW))
        j = gl.arange(0, CT // 16, layout=gl.SliceLayout(0, LW))
        rb = t // 32
        lane = t % 32
        word = (((rb // MB) * 32 + lane) * MB + rb % MB) * (C // 32) + C0 // 32
        return 2 * word[:, None] + j[None, :]

    @gluon.jit
    def _and_nibble(x, J: gl.constexpr):
        """``x & (0x000F000F << 4J)`` on packed uint16 pairs, read as fp16x2 (one ``and.b32`` per two 4-bit codes)."""
        if J == 0:
            return gl.inline_asm_elementwise("and.b32 $0, $1, 0x000F000F;", "=r,r", [x], dtype=gl.float16,
                                             is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise("and.b32 $0, $1, 0x00F000F0;", "=r,r", [x], dtype=gl.float16,
                                             is_pure=True, pack=2)

    @gluon.jit
    def word_offsets4(R: gl.constexpr, C: gl.constexpr, C0: gl.constexpr, CT: gl.constexpr, LW: gl.constexpr):
        """:func:`word_offsets` of 4-bit codes (``reference.pack_mma16(..., bits=4)``): uint16 offsets ``[R // 16 *
        32, CT // 8]``, row ``rb * 32 + lane``, column ``2 * w + e`` (word ``C0 // 16 + w``, half ``e``)."""
        MB0: gl.constexpr = 64 // C if C < 64 else 1
        MB: gl.constexpr = MB0 if (R // 16) % MB0 == 0 else 1
        t = gl.arange(0, R // 16 * 32, layout=gl.SliceLayout(1, LW))
        j = gl.arange(0, CT // 8, layout=gl.SliceLayout(0, LW))
        rb = t // 32
        lane = t % 32
        word = (((rb // MB) * 32 + lane) * MB + rb % MB) * (C // 16) + C0 // 16
        return 2 * word[:, None] + j[None, :]

    @gluon.jit
    def a_operand4(h, R: gl.constexpr, CT: gl.constexpr, A_LAYOUT: gl.constexpr):
        """uint16 halves ``h [R // 16 * 32, CT // 8]`` of 4-bit codes (:func:`word_offsets4`) -> the fp16 ``[R, CT]``
        wgmma A operand: code ``(16 rb + 8 hr + g, 16 w + 8 hc + 2 tq + e)`` as ``c·16^hr·2^-24`` (the ``hc`` field
        shifted down by the ``shr``: no power of two on the K dim). ``assert_trivial`` as in :func:`a_operand`."""
        RB: gl.constexpr = R // 16
        W: gl.constexpr = CT // 16
        x = gl.reshape(h, [RB, 8, 4, W, 2])  # (rb, g, tq, w, e)
        x8 = gl.reshape(_shr8(h), [RB, 8, 4, W, 2])
        j = gl.join(gl.join(_and_nibble(x, 0), _and_nibble(x, 1)), gl.join(_and_nibble(x8, 0), _and_nibble(x8, 1)))
        j = gl.permute(j, [0, 5, 1, 3, 6, 2, 4])  # (rb, g, tq, w, e, hr, hc) -> (rb, hr, g, w, hc, tq, e)
        return gl.convert_layout(gl.reshape(j, [R, CT]), A_LAYOUT, assert_trivial=True)

    @gluon.jit
    def a_operand(h, R: gl.constexpr, CT: gl.constexpr, A_LAYOUT: gl.constexpr):
        """uint16 halves ``h [R // 16 * 32, CT // 16]`` (:func:`word_offsets`) -> the fp16 ``[R, CT]`` wgmma A
        operand: code ``(16 rb + 8 hr + g, 32 w + 16 kb + 8 hc + 2 tq + e)`` as ``c·4^(2hc + hr)·2^-24``.
        The compiler must find the rebuilt tile already in ``A_LAYOUT`` (``assert_trivial``)."""
        RB: gl.constexpr = R // 16
        W: gl.constexpr = CT // 32
        h8 = _shr8(h)
        x = gl.reshape(h, [RB, 8, 4, W, 2])  # (rb, g, tq, w, e)
        x8 = gl.reshape(h8, [RB, 8, 4, W, 2])
        # field k = 4 kb + 2 hc + hr: join hr, then hc, then kb as new minor axes
        j0 = gl.join(gl.join(_and_field(x, 0), _and_field(x, 1)), gl.join(_and_field(x, 2), _and_field(x, 3)))
        j1 = gl.join(gl.join(_and_field(x8, 0), _and_field(x8, 1)), gl.join(_and_field(x8, 2), _and_field(x8, 3)))
        j = gl.join(j0, j1)  # (rb, g, tq, w, e, hr, hc, kb)
        j = gl.permute(j, [0, 5, 1, 3, 7, 6, 2, 4])  # (rb, hr, g, w, kb, hc, tq, e)
        return gl.convert_layout(gl.reshape(j, [R, CT]), A_LAYOUT, assert_trivial=True)


__all__ = ["a_operand", "a_operand4", "word_offsets", "word_offsets4"] if HAVE_GLUON else []
