"""The codes of the page quantizer (:mod:`.quant_pack`): a group's fp16 ``(scale, lo)`` from its clipped range, a
value's 2- or 4-bit code from its group's threshold, lo and scale, the store of a tile of codes in mma16 order, and
the range factors as compile-time constants. Shared by the token-group pass (:mod:`.quant_token`), the channel-group
pass (:mod:`.quant_channel`) and the rotated-input tile (``quant_pack._store_tile``); the arithmetic is
``reference.quantize_groups``'s, bit for bit. Tested through ``quant_pack.quantize_pages``
(tests/kernels/test_quant_pack.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .cache_keys import hash_bottom_up
from .layout import ONE_THIRD_F32, PACK_MMA16_KEY
from .mma16 import store_mma16
from .reference import span_inverse

#: fp32 1/3 as a compile-time constant (Triton kernels read only constexpr globals).
ONE_THIRD = tl.constexpr(ONE_THIRD_F32)
#: fp32 1/15, the range factor of 4-bit pages (16 levels), as a compile-time constant.
ONE_FIFTEENTH = tl.constexpr(span_inverse(16))
#: the PACKING constexpr of mma16 keys (layout.packing_code), as a constexpr global.
MMA16_KEY = tl.constexpr(PACK_MMA16_KEY)


@triton.jit
def scale_lo(mn, mx, thr, BITS: tl.constexpr):
    """The fp16 ``(scale, lo)`` of a group spanning ``[mn, mx]`` clipped to ``[-thr, thr]``: ``scale = (hi - lo)`` times
    the fp32 reciprocal of the top level (3, or 15 for 4-bit codes), as the reference rounds it."""
    lo = tl.minimum(tl.maximum(mn, -thr), thr)
    hi = tl.minimum(tl.maximum(mx, -thr), thr)
    if BITS == 4:
        scale16 = ((hi - lo) * ONE_FIFTEENTH).to(tl.float16)
    else:
        scale16 = ((hi - lo) * ONE_THIRD).to(tl.float16)
    return scale16, lo.to(tl.float16)


@triton.jit
def code2bit(x, thr, lof, ts0, ts1, ts2):
    """The 2-bit code of ``x`` (int32) given its group's threshold, float(lo16) and ``t_j * scale``."""
    d = tl.minimum(tl.maximum(x, -thr), thr) - lof
    return (d >= ts0).to(tl.int32) + (d >= ts1).to(tl.int32) + (d >= ts2).to(tl.int32)


@triton.jit
def code4bit(x, thr, lof, s):
    """The 4-bit code of ``x`` (int32): ``Σ_j [d >= (j + 1/2) s]`` over the 15 midpoints of the uniform levels
    ``0..15`` (the reference's ``t_j * s`` in fp32), ``s`` = float(scale16)."""
    d = tl.minimum(tl.maximum(x, -thr), thr) - lof
    code = (d >= 0.5 * s).to(tl.int32)
    for j in tl.static_range(1, 15):
        code += (d >= (j + 0.5) * s).to(tl.int32)
    return code


@triton.jit
def store_codes_mma16(codes_base, code, t0, P: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                       PACKING: tl.constexpr, BITS: tl.constexpr = 2):
    """Store the ``BITS``-bit codes ``code [T, D]`` of tokens ``t0 .. t0 + T`` of a page-head in mma16 order: keys as
    rows of the ``[P, D]`` matrix, values (``PACKING == PACK_MMA16_VALUE``) as columns of the ``[D, P]`` one."""
    # MB = reference.mma16_group(rows, cols, BITS) as constexpr arithmetic (a jit function cannot call Python helpers)
    if PACKING == MMA16_KEY:
        KB0: tl.constexpr = 256 // (D * BITS) if D * BITS < 256 else 1
        KMB: tl.constexpr = KB0 if (P // 16) % KB0 == 0 else 1
        store_mma16(codes_base, code, t0, 0, P, D, T, D, KMB, BITS)
    else:
        VB0: tl.constexpr = 256 // (P * BITS) if P * BITS < 256 else 1
        VMB: tl.constexpr = VB0 if (D // 16) % VB0 == 0 else 1
        store_mma16(codes_base, tl.trans(code), 0, t0, D, P, D, T, VMB, BITS)


hash_bottom_up(globals())  # one Triton cache key per helper, whatever kernel launches first (cache_keys.py)

__all__ = ["MMA16_KEY", "ONE_FIFTEENTH", "ONE_THIRD", "code2bit", "code4bit", "scale_lo", "store_codes_mma16"]
