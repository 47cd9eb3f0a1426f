"""The page quantizer's pass over one page-head of token groups (each row's ``D // G`` groups of ``G`` values): the
clip threshold of every group (:mod:`.clip_threshold`), its fp16 ``(scale, lo)`` and the packed codes, in linear or
mma16 order. Called by ``quant_pack.quantize_page`` (the prefill write and the decode step's demotion); tested
through ``quant_pack.quantize_pages`` (tests/kernels/test_quant_pack.py, the ``token`` cases).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .cache_keys import hash_bottom_up
from .clip_threshold import ins_chunks, merge8, prep, resolve
from .mma16 import repack_linear_to_mma16
from .quant_codes import MMA16_KEY, code2bit, code4bit, scale_lo, store_codes_mma16


@triton.jit
def _row_round(ptrs, cut, bound, S: tl.constexpr, Q: tl.constexpr, C: tl.constexpr, FIRST: tl.constexpr):
    """One pass over the token groups at ``ptrs [S, Q]`` (+ k*Q: quarter k): see :func:`resolve`.

    Returns the 8 largest ``|x| < cut`` per row, the count in ``[cut, bound)`` and (FIRST) min/max of x.
    """
    neg = tl.full((S, Q // C), -1.0, tl.float32)
    t0, t1, t2, t3, t4, t5, t6, t7 = neg, neg, neg, neg, neg, neg, neg, neg
    cnt = tl.zeros((S, Q), tl.int32)
    mn = tl.full((S, Q), float("inf"), tl.float32)
    mx = tl.full((S, Q), float("-inf"), tl.float32)
    for k in tl.static_range(4):
        a, mn, mx, cnt = prep(tl.load(ptrs + k * Q).to(tl.float32), cut[:, None], bound[:, None], mn, mx, cnt, FIRST)
        t0, t1, t2, t3, t4, t5, t6, t7 = ins_chunks(t0, t1, t2, t3, t4, t5, t6, t7,
                                                     tl.reshape(a, (S, Q // C, C)), C, k == 0)
    t0, t1, t2, t3, t4, t5, t6, t7 = tl.reduce((t0, t1, t2, t3, t4, t5, t6, t7), 1, merge8)
    return t0, t1, t2, t3, t4, t5, t6, t7, tl.sum(cnt, 1), tl.min(mn, 1), tl.max(mx, 1)


@triton.jit
def token_pages(x_base, stride_xp, codes_base, params_base, keep, lv0, lv1, lv2, lv3,
                 P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PACKING: tl.constexpr = 0,
                 BITS: tl.constexpr = 2):
    """Quantize one page-head of token groups: ``x_base`` rows ``[P, D]`` (row stride ``stride_xp``).

    Rows go in blocks of S; each thread holds C contiguous values of a quarter row per load, the four
    quarters (bits 0, 2, 4, 6 of a code byte) are loaded separately so a byte is packed in one thread.
    ``PACKING`` (``layout.packing_code``) != 0: with one group per row, the page-head is written in linear order
    and then repacked in place (``mma16.repack_linear_to_mma16``: no exchange between threads); with several, the
    codes of a row block are computed on whole rows after its groups' thresholds (same arithmetic) and stored in
    mma16 order (:mod:`.mma16`). ``BITS == 4``: 16 uniform
    levels (``lv*`` unused), quarters 0 | 2 << 4 into bytes ``g G/2 + q``, 1 | 3 << 4 into ``g G/2 + G/4 + q``; mma16
    pages (keys) are written so and repacked in place, whatever the groups per row.
    """
    Q: tl.constexpr = G // 4
    C: tl.constexpr = 8 if Q >= 8 else Q
    S: tl.constexpr = 32 if P >= 32 else P
    NG: tl.constexpr = D // G
    r = tl.arange(0, S)
    q = tl.arange(0, Q)
    inf = tl.full((S,), float("inf"), tl.float32)
    t0p = (lv0 + lv1) * 0.5
    t1p = (lv1 + lv2) * 0.5
    t2p = (lv2 + lv3) * 0.5
    for rb in range(0, P, S):
        if PACKING != 0 and NG > 1 and BITS == 2:  # per-element group parameters of the row block (whole-row codes)
            colg = tl.arange(0, D)[None, :] // G
            thr_f = tl.zeros((S, D), tl.float32)
            lof_f = tl.zeros((S, D), tl.float32)
            ts0_f = tl.zeros((S, D), tl.float32)
            ts1_f = tl.zeros((S, D), tl.float32)
            ts2_f = tl.zeros((S, D), tl.float32)
        for g in tl.static_range(NG):
            ptrs = x_base + (rb + r)[:, None] * stride_xp + (g * G + q)[None, :]
            t0, t1, t2, t3, t4, t5, t6, t7, c, mn, mx = _row_round(ptrs, inf, inf, S, Q, C, True)
            kr, done, thr = resolve(t0, t1, t2, t3, t4, t5, t6, t7, c, inf, tl.zeros((S,), tl.int32) + keep,
                                     tl.zeros((S,), tl.int32), tl.zeros((S,), tl.float32))
            cut = inf
            if keep > 8:  # uniform: K <= 8 is resolved by the first round, skip the cross-warp check
                while tl.min(done, 0) == 0:
                    bound = cut
                    cut = t7
                    t0, t1, t2, t3, t4, t5, t6, t7, c, _, _ = _row_round(ptrs, cut, bound, S, Q, C, False)
                    kr, done, thr = resolve(t0, t1, t2, t3, t4, t5, t6, t7, c, cut, kr, done, thr)
            scale16, lo16 = scale_lo(mn, mx, thr, BITS)
            s = scale16.to(tl.float32)
            lof = lo16.to(tl.float32)[:, None]
            ts0 = (t0p * s)[:, None]
            ts1 = (t1p * s)[:, None]
            ts2 = (t2p * s)[:, None]
            if BITS == 4:
                th = thr[:, None]
                s2 = s[:, None]
                low = code4bit(tl.load(ptrs).to(tl.float32), th, lof, s2)
                low |= code4bit(tl.load(ptrs + 2 * Q).to(tl.float32), th, lof, s2) << 4
                high = code4bit(tl.load(ptrs + Q).to(tl.float32), th, lof, s2)
                high |= code4bit(tl.load(ptrs + 3 * Q).to(tl.float32), th, lof, s2) << 4
                dst = codes_base + (rb + r)[:, None] * (D // 2) + (g * (G // 2) + q)[None, :]
                tl.store(dst, low.to(tl.uint8))
                tl.store(dst + Q, high.to(tl.uint8))
            elif PACKING == 0 or NG == 1:  # mma16 with one group per row: linear first, repacked below
                packed = tl.zeros((S, Q), tl.int32)
                for k in tl.static_range(4):
                    x = tl.load(ptrs + k * Q).to(tl.float32)
                    d = tl.minimum(tl.maximum(x, -thr[:, None]), thr[:, None]) - lof
                    code = (d >= ts0).to(tl.int32) + (d >= ts1).to(tl.int32) + (d >= ts2).to(tl.int32)
                    packed = packed | (code << (2 * k))
                tl.store(codes_base + (rb + r)[:, None] * (D // 4) + (g * Q + q)[None, :], packed.to(tl.uint8))
            else:
                here = colg == g
                thr_f = tl.where(here, thr[:, None], thr_f)
                lof_f = tl.where(here, lof, lof_f)
                ts0_f = tl.where(here, ts0, ts0_f)
                ts1_f = tl.where(here, ts1, ts1_f)
                ts2_f = tl.where(here, ts2, ts2_f)
            # (scale, lo) as one 32-bit word per row, stored by the thread holding column 0 of the tile
            # (a [S] vector would be re-laid through shared memory first)
            word = (scale16.to(tl.uint16, bitcast=True).to(tl.uint32)
                    | (lo16.to(tl.uint16, bitcast=True).to(tl.uint32) << 16))
            prm = (params_base + ((rb + r) * NG + g) * 2).to(tl.pointer_type(tl.uint32))
            tl.store(prm[:, None] + 0 * q[None, :], word[:, None] + 0 * q[None, :].to(tl.uint32),
                     mask=q[None, :] == 0)
        if PACKING != 0 and NG > 1 and BITS == 2:
            x = tl.load(x_base + (rb + r)[:, None] * stride_xp + tl.arange(0, D)[None, :]).to(tl.float32)
            store_codes_mma16(codes_base, code2bit(x, thr_f, lof_f, ts0_f, ts1_f, ts2_f), rb, P, D, S, PACKING)
    if PACKING != 0 and (NG == 1 or BITS == 4):
        tl.debug_barrier()  # the linear codes of every row block are written (by other threads too)
        repack_linear_to_mma16(codes_base, P, D, PACKING != MMA16_KEY, G, BITS)


hash_bottom_up(globals())  # one Triton cache key per helper, whatever kernel launches first (cache_keys.py)

__all__ = ["token_pages"]
