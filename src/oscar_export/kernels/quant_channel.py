"""The page quantizer's pass over one page-head of channel groups (keys with ``granularity="channel"``: each of the
``D`` channels one group over the page's ``P`` tokens): the clip threshold of every channel (:mod:`.clip_threshold`,
``T`` tokens a load), its fp16 ``(scale, lo)`` and the packed codes (bytes packed along ``D`` by ``G``), in linear or
mma16 order. Called by ``quant_pack.quantize_page``; tested through ``quant_pack.quantize_pages``
(tests/kernels/test_quant_pack.py, the ``channel`` cases).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .cache_keys import hash_bottom_up
from .clip_threshold import add8, ins, merge8, prep, resolve
from .quant_codes import code2bit, code4bit, scale_lo, store_codes_mma16


@triton.jit
def _channel_block(t0, t1, t2, t3, t4, t5, t6, t7, rows, stride_xp, cut, bound, mn, mx, cnt,
                   T: tl.constexpr, FIRST: tl.constexpr):
    """Add 8 loads of T tokens each (``rows [T, D]`` pointers, then + j*T rows) to the channel lists."""
    e0, mn, mx, cnt = prep(tl.load(rows).to(tl.float32), cut, bound, mn, mx, cnt, FIRST)
    e1, mn, mx, cnt = prep(tl.load(rows + 1 * T * stride_xp).to(tl.float32), cut, bound, mn, mx, cnt, FIRST)
    e2, mn, mx, cnt = prep(tl.load(rows + 2 * T * stride_xp).to(tl.float32), cut, bound, mn, mx, cnt, FIRST)
    e3, mn, mx, cnt = prep(tl.load(rows + 3 * T * stride_xp).to(tl.float32), cut, bound, mn, mx, cnt, FIRST)
    e4, mn, mx, cnt = prep(tl.load(rows + 4 * T * stride_xp).to(tl.float32), cut, bound, mn, mx, cnt, FIRST)
    e5, mn, mx, cnt = prep(tl.load(rows + 5 * T * stride_xp).to(tl.float32), cut, bound, mn, mx, cnt, FIRST)
    e6, mn, mx, cnt = prep(tl.load(rows + 6 * T * stride_xp).to(tl.float32), cut, bound, mn, mx, cnt, FIRST)
    e7, mn, mx, cnt = prep(tl.load(rows + 7 * T * stride_xp).to(tl.float32), cut, bound, mn, mx, cnt, FIRST)
    t0, t1, t2, t3, t4, t5, t6, t7 = add8(t0, t1, t2, t3, t4, t5, t6, t7, e0, e1, e2, e3, e4, e5, e6, e7, False)
    return t0, t1, t2, t3, t4, t5, t6, t7, mn, mx, cnt


@triton.jit
def _channel_round(x_base, stride_xp, cut, bound, P: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                   FIRST: tl.constexpr):
    """One pass over the channel groups (``[P, D]`` rows, T tokens per load): see :func:`_row_round`.

    With ``P >= 8 T`` the tokens go 8 loads at a time (sorted, merged); else one at a time (insertion).
    """
    t = tl.arange(0, T)
    i = tl.arange(0, D)
    neg = tl.full((T, D), -1.0, tl.float32)
    t0, t1, t2, t3, t4, t5, t6, t7 = neg, neg, neg, neg, neg, neg, neg, neg
    cnt = tl.zeros((T, D), tl.int32)
    mn = tl.full((T, D), float("inf"), tl.float32)
    mx = tl.full((T, D), float("-inf"), tl.float32)
    cut2 = cut[None, :]
    bound2 = bound[None, :]
    rows = x_base + t[:, None] * stride_xp + i[None, :]
    if P >= 8 * T:  # one loop body (no first block peeled: merging into the empty (-1) lists keeps the same 8)
        for tb in range(0, P, 8 * T):
            t0, t1, t2, t3, t4, t5, t6, t7, mn, mx, cnt = _channel_block(
                t0, t1, t2, t3, t4, t5, t6, t7, rows + tb * stride_xp, stride_xp, cut2, bound2, mn, mx, cnt,
                T, FIRST)
    else:
        for tb in range(0, P, T):
            a, mn, mx, cnt = prep(tl.load(rows + tb * stride_xp).to(tl.float32), cut2, bound2, mn, mx, cnt, FIRST)
            t0, t1, t2, t3, t4, t5, t6, t7 = ins(t0, t1, t2, t3, t4, t5, t6, t7, a)
    t0, t1, t2, t3, t4, t5, t6, t7 = tl.reduce((t0, t1, t2, t3, t4, t5, t6, t7), 0, merge8)
    return t0, t1, t2, t3, t4, t5, t6, t7, tl.sum(cnt, 0), tl.min(mn, 0), tl.max(mx, 0)


@triton.jit
def _quarter(v, k: tl.constexpr, NG: tl.constexpr, Q: tl.constexpr):
    """``v [D]`` -> ``[NG, Q]``: the channels of quarter ``k`` of each group (exact: a max against -inf)."""
    w = tl.reshape(v, (NG, 4, Q))
    kk = tl.arange(0, 4)[None, :, None]
    return tl.max(tl.where(kk == k, w, float("-inf")), 1)


@triton.jit
def channel_pages(x_base, stride_xp, codes_base, params_base, keep, lv0, lv1, lv2, lv3,
                   P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PACKING: tl.constexpr = 0,
                   BITS: tl.constexpr = 2):
    """Quantize one page-head of channel groups (each channel over the P tokens; bytes packed along D by G);
    ``BITS`` as in :func:`token_pages`."""
    Q: tl.constexpr = G // 4
    NG: tl.constexpr = D // G
    T: tl.constexpr = 4 if P >= 32 else (P // 8 if P >= 8 else 1)
    i = tl.arange(0, D)
    inf = tl.full((D,), float("inf"), tl.float32)
    t0, t1, t2, t3, t4, t5, t6, t7, c, mn, mx = _channel_round(x_base, stride_xp, inf, inf, P, D, T, True)
    kr, done, thr = resolve(t0, t1, t2, t3, t4, t5, t6, t7, c, inf, tl.zeros((D,), tl.int32) + keep,
                             tl.zeros((D,), tl.int32), tl.zeros((D,), tl.float32))
    cut = inf
    if keep > 8:  # uniform: K <= 8 is resolved by the first round
        while tl.min(done, 0) == 0:
            bound = cut
            cut = t7
            t0, t1, t2, t3, t4, t5, t6, t7, c, _, _ = _channel_round(x_base, stride_xp, cut, bound, P, D, T, False)
            kr, done, thr = resolve(t0, t1, t2, t3, t4, t5, t6, t7, c, cut, kr, done, thr)
    scale16, lo16 = scale_lo(mn, mx, thr, BITS)
    tl.store(params_base + i, scale16)
    tl.store(params_base + D + i, lo16)
    s = scale16.to(tl.float32)
    lof = lo16.to(tl.float32)
    ts0 = ((lv0 + lv1) * 0.5) * s
    ts1 = ((lv1 + lv2) * 0.5) * s
    ts2 = ((lv2 + lv3) * 0.5) * s
    if PACKING != 0:  # mma16: whole rows of 16 * MB tokens per step (keys only: channel groups)
        TB0: tl.constexpr = 256 // (D * BITS) if D * BITS < 256 else 1
        TM: tl.constexpr = 16 * (TB0 if (P // 16) % TB0 == 0 else 1)  # 16 * mma16_group(P, D, BITS)
        tm = tl.arange(0, TM)[:, None]
        for tb in range(0, P, TM):
            x = tl.load(x_base + (tb + tm) * stride_xp + i[None, :]).to(tl.float32)
            if BITS == 4:
                code = code4bit(x, thr[None, :], lof[None, :], s[None, :])
            else:
                code = code2bit(x, thr[None, :], lof[None, :], ts0[None, :], ts1[None, :], ts2[None, :])
            store_codes_mma16(codes_base, code, tb, P, D, TM, PACKING, BITS)
        return
    T3: tl.constexpr = 2 * T if P >= 2 * T else T  # tokens per step of the code pass
    t = tl.arange(0, T3)[:, None, None]
    col = (tl.arange(0, NG)[:, None] * G + tl.arange(0, Q)[None, :])[None, :, :]  # [1, NG, Q], quarter 0
    if BITS == 4:  # quarters 0 | 2 << 4 into bytes g G/2 + q, 1 | 3 << 4 into g G/2 + G/4 + q
        byte2 = (tl.arange(0, NG)[:, None] * (G // 2) + tl.arange(0, Q)[None, :])[None, :, :]
        th0, lo0, s0 = (_quarter(thr, 0, NG, Q)[None, :, :], _quarter(lof, 0, NG, Q)[None, :, :],
                        _quarter(s, 0, NG, Q)[None, :, :])
        th1, lo1, s1 = (_quarter(thr, 1, NG, Q)[None, :, :], _quarter(lof, 1, NG, Q)[None, :, :],
                        _quarter(s, 1, NG, Q)[None, :, :])
        th2, lo2, s2 = (_quarter(thr, 2, NG, Q)[None, :, :], _quarter(lof, 2, NG, Q)[None, :, :],
                        _quarter(s, 2, NG, Q)[None, :, :])
        th3, lo3, s3 = (_quarter(thr, 3, NG, Q)[None, :, :], _quarter(lof, 3, NG, Q)[None, :, :],
                        _quarter(s, 3, NG, Q)[None, :, :])
        for tb in range(0, P, T3):
            rows = x_base + (tb + t) * stride_xp + col
            low = code4bit(tl.load(rows).to(tl.float32), th0, lo0, s0)
            low |= code4bit(tl.load(rows + 2 * Q).to(tl.float32), th2, lo2, s2) << 4
            high = code4bit(tl.load(rows + Q).to(tl.float32), th1, lo1, s1)
            high |= code4bit(tl.load(rows + 3 * Q).to(tl.float32), th3, lo3, s3) << 4
            dst = codes_base + (tb + t) * (D // 2) + byte2
            tl.store(dst, low.to(tl.uint8))
            tl.store(dst + Q, high.to(tl.uint8))
        return
    byte = (tl.arange(0, NG)[:, None] * Q + tl.arange(0, Q)[None, :])[None, :, :]
    th0, lo0 = _quarter(thr, 0, NG, Q)[None, :, :], _quarter(lof, 0, NG, Q)[None, :, :]
    a0, b0, c0 = (_quarter(ts0, 0, NG, Q)[None, :, :], _quarter(ts1, 0, NG, Q)[None, :, :],
                  _quarter(ts2, 0, NG, Q)[None, :, :])
    th1, lo1 = _quarter(thr, 1, NG, Q)[None, :, :], _quarter(lof, 1, NG, Q)[None, :, :]
    a1, b1, c1 = (_quarter(ts0, 1, NG, Q)[None, :, :], _quarter(ts1, 1, NG, Q)[None, :, :],
                  _quarter(ts2, 1, NG, Q)[None, :, :])
    th2, lo2 = _quarter(thr, 2, NG, Q)[None, :, :], _quarter(lof, 2, NG, Q)[None, :, :]
    a2, b2, c2 = (_quarter(ts0, 2, NG, Q)[None, :, :], _quarter(ts1, 2, NG, Q)[None, :, :],
                  _quarter(ts2, 2, NG, Q)[None, :, :])
    th3, lo3 = _quarter(thr, 3, NG, Q)[None, :, :], _quarter(lof, 3, NG, Q)[None, :, :]
    a3, b3, c3 = (_quarter(ts0, 3, NG, Q)[None, :, :], _quarter(ts1, 3, NG, Q)[None, :, :],
                  _quarter(ts2, 3, NG, Q)[None, :, :])
    for tb in range(0, P, T3):
        rows = x_base + (tb + t) * stride_xp + col
        packed = code2bit(tl.load(rows).to(tl.float32), th0, lo0, a0, b0, c0)
        packed |= code2bit(tl.load(rows + Q).to(tl.float32), th1, lo1, a1, b1, c1) << 2
        packed |= code2bit(tl.load(rows + 2 * Q).to(tl.float32), th2, lo2, a2, b2, c2) << 4
        packed |= code2bit(tl.load(rows + 3 * Q).to(tl.float32), th3, lo3, a3, b3, c3) << 6
        tl.store(codes_base + (tb + t) * (D // 4) + byte, packed.to(tl.uint8))


hash_bottom_up(globals())  # one Triton cache key per helper, whatever kernel launches first (cache_keys.py)

__all__ = ["channel_pages"]
