"""The portable split kernel's INT2 pages when one token group spans the row (``G == D``: head_dim 64, and 128 with
its default groups): :func:`row_pages`, one split's pages with one ``(scale, lo)`` per token row (or, ``K_CHANNEL``,
per channel of the page for keys). A ``@triton.jit`` function inlined into ``decode/portable.py``'s
``decode_split_kernel`` (its module doc explains the arithmetic), built on the page helpers of
``portable_pages.py``; the ``G < D`` twin is ``portable_grouped.py``'s :func:`grouped_pages`. Tested through the
kernel (tests/kernels/test_decode_portable.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..cache_keys import hash_bottom_up
from .portable_pages import field_scaled, key_scores, nibble_scaled, slot_row, token_params


@triton.jit
def row_pages(
    q0, q1, q2, q3, k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
    block_table_ptr, num_pages_ptr, b, h, s, max_pages, pages_per_split,
    H_KV: tl.constexpr, GQ_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_CODEBOOK: tl.constexpr, V_CODEBOOK: tl.constexpr, FAST_UNPACK: tl.constexpr,
    NB: tl.constexpr, KEY_BITS: tl.constexpr,
):
    """The INT2 pages of split ``s`` when a row is one token group (``G == D``): the ``NB`` page slots on the batch
    axis of the 3-D dots, each with its own online softmax (``m, den [NB, GQ_PAD]``, accumulators ``[NB, GQ_PAD,
    D/4]``; slots past the split's last page load nothing and score ``-inf``), combined after the loop by their
    log-sum-exp. ``q0..q3``: the query quarters ``[GQ_PAD, D/4]`` (fp16, times ``sm_scale·log2(e)``). Returns ``m,
    den [GQ_PAD]``, the four output quarters ``[GQ_PAD, D/4]`` (levels scaled back) and the value lows ``[GQ_PAD,
    1]``, like :func:`grouped_pages`."""
    Q4: tl.constexpr = D // 4
    KR: tl.constexpr = D * KEY_BITS // 8  # key code bytes per row
    c4 = tl.arange(0, Q4)
    kl0 = tl.load(k_levels_ptr + h * 4 + 0)
    kl1 = tl.load(k_levels_ptr + h * 4 + 1)
    kl2 = tl.load(k_levels_ptr + h * 4 + 2)
    kl3 = tl.load(k_levels_ptr + h * 4 + 3)
    vl0 = tl.load(v_levels_ptr + h * 4 + 0)
    vl1 = tl.load(v_levels_ptr + h * 4 + 1)
    vl2 = tl.load(v_levels_ptr + h * 4 + 2)
    vl3 = tl.load(v_levels_ptr + h * 4 + 3)
    qsum = tl.sum(q0.to(tl.float32) + q1.to(tl.float32) + q2.to(tl.float32) + q3.to(tl.float32), axis=1)
    # every page slot sees the same queries: [NB, GQ_PAD, Q4]
    # uniform codes arrive as c·4^j·2^-24 (field_scaled): quarter j of q carries 4^-j (exact), the
    # scores 2^24 (KU), the value quarters 2^24·4^-j (VU, after the loop)
    if KEY_BITS == 4:  # nibbles arrive as c·16^n·2^-24 (nibble_scaled): quarters 2, 3 are high nibbles
        KU = 16777216.0
        qb0 = tl.broadcast_to(q0.to(tl.float32)[None, :, :], (NB, GQ_PAD, Q4))
        qb1 = tl.broadcast_to(q1.to(tl.float32)[None, :, :], (NB, GQ_PAD, Q4))
        qb2 = tl.broadcast_to(q2.to(tl.float32)[None, :, :] * 0.0625, (NB, GQ_PAD, Q4))
        qb3 = tl.broadcast_to(q3.to(tl.float32)[None, :, :] * 0.0625, (NB, GQ_PAD, Q4))
    elif K_CODEBOOK:
        KU = 1.0
        qb0 = tl.broadcast_to(q0.to(tl.float32)[None, :, :], (NB, GQ_PAD, Q4))
        qb1 = tl.broadcast_to(q1.to(tl.float32)[None, :, :], (NB, GQ_PAD, Q4))
        qb2 = tl.broadcast_to(q2.to(tl.float32)[None, :, :], (NB, GQ_PAD, Q4))
        qb3 = tl.broadcast_to(q3.to(tl.float32)[None, :, :], (NB, GQ_PAD, Q4))
    else:
        KU = 16777216.0
        qb0 = tl.broadcast_to(q0.to(tl.float32)[None, :, :], (NB, GQ_PAD, Q4))
        qb1 = tl.broadcast_to(q1.to(tl.float32)[None, :, :] * 0.25, (NB, GQ_PAD, Q4))
        qb2 = tl.broadcast_to(q2.to(tl.float32)[None, :, :] * 0.0625, (NB, GQ_PAD, Q4))
        qb3 = tl.broadcast_to(q3.to(tl.float32)[None, :, :] * 0.015625, (NB, GQ_PAD, Q4))
    # B operands of the transposed scores
    qt0 = tl.permute(qb0.to(tl.float16), (0, 2, 1))
    qt1 = tl.permute(qb1.to(tl.float16), (0, 2, 1))
    qt2 = tl.permute(qb2.to(tl.float16), (0, 2, 1))
    qt3 = tl.permute(qb3.to(tl.float16), (0, 2, 1))
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
    t = tl.arange(0, P)
    tile = (t[:, None] * Q4 + c4[None, :])[None, :, :]  # [1, P, Q4]
    ktile4 = (t[:, None] * KR + c4[None, :])[None, :, :]  # 4-bit keys: quarters 0 | 2 (+ Q4: 1 | 3)
    bm = tl.full([NB, GQ_PAD], float("-inf"), tl.float32)
    bl = tl.zeros([NB, GQ_PAD], tl.float32)
    b0 = tl.zeros([NB, GQ_PAD, Q4], tl.float32)
    b1 = tl.zeros([NB, GQ_PAD, Q4], tl.float32)
    b2 = tl.zeros([NB, GQ_PAD, Q4], tl.float32)
    b3 = tl.zeros([NB, GQ_PAD, Q4], tl.float32)
    blo = tl.zeros([NB, GQ_PAD], tl.float32)
    start = s * pages_per_split
    end = tl.minimum(start + pages_per_split, tl.load(num_pages_ptr + b))
    for p0 in range(start, end, NB):
        slot = p0 + nb
        ok = slot < end
        page = tl.load(block_table_ptr + b.to(tl.int64) * max_pages + slot, mask=ok, other=0).to(tl.int64)
        ph = page * H_KV + h
        code_off = tl.multiple_of(ph * (P * Q4), 16)
        word_off = tl.multiple_of(ph * P, 16)  # token rows' (scale, lo) as one 32-bit word each
        okc = ok[:, None, None]
        if KEY_BITS == 4:
            koff = tl.multiple_of(ph * (P * KR), 16)
            ka = tl.load(k_codes_ptr + koff[:, None, None] + ktile4, mask=okc, other=0)  # [NB, P, Q4] uint8
            kb = tl.load(k_codes_ptr + koff[:, None, None] + ktile4 + Q4, mask=okc, other=0)
        else:
            kc = tl.load(k_codes_ptr + code_off[:, None, None] + tile, mask=okc, other=0)  # [NB, P, Q4] uint8
            ka = kc  # what key_scores reads (its 2-bit path ignores kb)
            kb = kc
        vc = tl.load(v_codes_ptr + code_off[:, None, None] + tile, mask=okc, other=0)
        # scores transposed: [NB, P, GQ_PAD] = K_j [NB, P, Q4] · q_j^T [NB, Q4, GQ_PAD]
        if K_CHANNEL:
            kw = tl.multiple_of(ph * D, 16)  # [2, D] fp16 (scales, then lows) = D words per page-head
            ks0 = slot_row(k_params_ptr, kw + 0 * Q4 // 2, ok, Q4)
            ks1 = slot_row(k_params_ptr, kw + 1 * Q4 // 2, ok, Q4)
            ks2 = slot_row(k_params_ptr, kw + 2 * Q4 // 2, ok, Q4)
            ks3 = slot_row(k_params_ptr, kw + 3 * Q4 // 2, ok, Q4)
            # q·lo over the page's channel lows: one reduction for the four quarters
            qlo = q0.to(tl.float32)[None, :, :] * slot_row(k_params_ptr, kw + (D + 0 * Q4) // 2, ok, Q4)
            qlo += q1.to(tl.float32)[None, :, :] * slot_row(k_params_ptr, kw + (D + 1 * Q4) // 2, ok, Q4)
            qlo += q2.to(tl.float32)[None, :, :] * slot_row(k_params_ptr, kw + (D + 2 * Q4) // 2, ok, Q4)
            qlo += q3.to(tl.float32)[None, :, :] * slot_row(k_params_ptr, kw + (D + 3 * Q4) // 2, ok, Q4)
            const = tl.sum(qlo, axis=2)
            if KEY_BITS == 4:
                st_ = tl.dot(nibble_scaled(ka, 0, FAST_UNPACK),
                             tl.permute(qb0.to(tl.float16) * ks0.to(tl.float16), (0, 2, 1)))
                st_ = tl.dot(nibble_scaled(kb, 0, FAST_UNPACK),
                             tl.permute(qb1.to(tl.float16) * ks1.to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(nibble_scaled(ka, 1, FAST_UNPACK),
                             tl.permute(qb2.to(tl.float16) * ks2.to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(nibble_scaled(kb, 1, FAST_UNPACK),
                             tl.permute(qb3.to(tl.float16) * ks3.to(tl.float16), (0, 2, 1)), st_)
            else:
                st_ = tl.dot(field_scaled(kc, 0, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute(qb0.to(tl.float16) * ks0.to(tl.float16), (0, 2, 1)))
                st_ = tl.dot(field_scaled(kc, 1, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute(qb1.to(tl.float16) * ks1.to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(field_scaled(kc, 2, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute(qb2.to(tl.float16) * ks2.to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(field_scaled(kc, 3, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute(qb3.to(tl.float16) * ks3.to(tl.float16), (0, 2, 1)), st_)
            st_ = st_ * KU + const[:, None, :]
        else:
            ks, klo = token_params(k_params_ptr, word_off, t, ok)
            st_ = key_scores(ka, kb, qt0, qt1, qt2, qt3, kl0, kl1, kl2, kl3, KEY_BITS, K_CODEBOOK, FAST_UNPACK)
            st_ = st_ * (ks * KU)[:, :, None] + klo[:, :, None] * qsum[None, None, :]
        st_ = tl.where(okc, st_, float("-inf"))
        m_new = tl.maximum(bm, tl.max(st_, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(bm - m_use)
        pt = tl.exp2(st_ - m_use[:, None, :])
        bl = bl * alpha + tl.sum(pt, axis=1)
        bm = m_new
        vs, vlo = token_params(v_params_ptr, word_off, t, ok)
        ps = tl.permute((pt * vs[:, :, None]).to(tl.float16), (0, 2, 1))
        plo = tl.sum(pt * vlo[:, :, None], axis=1)
        b0 = tl.dot(ps, field_scaled(vc, 0, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK),
                    b0 * alpha[:, :, None])
        b1 = tl.dot(ps, field_scaled(vc, 1, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK),
                    b1 * alpha[:, :, None])
        b2 = tl.dot(ps, field_scaled(vc, 2, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK),
                    b2 * alpha[:, :, None])
        b3 = tl.dot(ps, field_scaled(vc, 3, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK),
                    b3 * alpha[:, :, None])
        blo = blo * alpha + plo
    # ---- combine the page slots by their log-sum-exp -------------------------------------------------
    m = tl.max(bm, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(bm - m_use[None, :])  # [NB, GQ_PAD]; empty slots weigh 0
    den = tl.sum(bl * w, axis=0)
    acc0 = tl.sum(b0 * w[:, :, None], axis=0) * VU0
    acc1 = tl.sum(b1 * w[:, :, None], axis=0) * VU1
    acc2 = tl.sum(b2 * w[:, :, None], axis=0) * VU2
    acc3 = tl.sum(b3 * w[:, :, None], axis=0) * VU3
    acclo = tl.sum(blo * w, axis=0)[:, None]

    return m, den, acc0, acc1, acc2, acc3, acclo


hash_bottom_up(globals())  # one Triton cache key per kernel, whatever launches first (cache_keys.py)

__all__ = ["row_pages"]
