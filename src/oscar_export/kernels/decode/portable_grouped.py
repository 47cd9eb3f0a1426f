"""The portable split kernel's INT2 pages when a row holds several token groups (``G < D``: head_dim 128 with groups
of 64, head_dim 256 with two of 128, Gemma 3): :func:`grouped_pages`, one split's pages with a ``(scale, lo)`` per
group, and its pieces: the group parameters read as 32-bit words (:func:`_slot_cols`, :func:`_group_params`) and the
reshapes between the (slot, group) and the row views (:func:`_per_group`, :func:`_per_slot`, :func:`_per_slot3`,
:func:`_columns`). ``@triton.jit`` functions inlined into ``decode/portable.py``'s ``decode_split_kernel`` (its
module doc explains the arithmetic), built on the page helpers of ``portable_pages.py``; tested through the kernel
(tests/kernels/test_decode_portable.py, the two-groups-a-row tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..cache_keys import hash_bottom_up
from .portable_pages import field_cols, field_scaled, key_scores, nibble_scaled


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
    ``word_off [NB] + cols`` split into even (low half) and odd (high half) channels (:func:`slot_row` for the
    non-contiguous channels of a field when ``G < D``)."""
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word_off[:, None] + cols[None, :], mask=ok[:, None], other=0)
    even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(tl.join(even, odd), (even.shape[0], 2 * cols.shape[0]))[:, None, :]


@triton.jit
def _group_params(params_ptr, word, ok):
    """fp16 ``(scale, lo)`` pairs as fp32, read as one 32-bit word each at ``word`` (any shape, in words;
    ``ok`` broadcastable mask): :func:`token_params` for rows of several groups."""
    w = tl.load(params_ptr.to(tl.pointer_type(tl.int32)) + word, mask=ok, other=0)
    scale = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    lo = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, lo


@triton.jit
def grouped_pages(
    q0, q1, q2, q3, k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
    block_table_ptr, num_pages_ptr, b, h, s, max_pages, pages_per_split,
    H_KV: tl.constexpr, GQ_PAD: tl.constexpr, D: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_CODEBOOK: tl.constexpr, V_CODEBOOK: tl.constexpr, FAST_UNPACK: tl.constexpr,
    NB: tl.constexpr, KEY_BITS: tl.constexpr = 2,
):
    """The INT2 pages of split ``s`` when a row holds ``NG = D // G > 1`` token groups (values, and keys unless
    ``K_CHANNEL``: then keys are scored as in the ``G == D`` path, one dot over all ``D/4`` bytes per field with
    the query scaled by the page's channel scales gathered at :func:`field_cols`).

    The ``NB`` page slots and the row's ``NG`` groups share the batch axis of the 3-D dots (``NB * NG``): each
    (slot, group) scores its ``G/4`` code bytes per field with its own ``(scale, lo)``
    (``q·k̂ = Σ_g s_g (q_g·lev[c_g]) + lo_g Σ q_g``), the groups' scores are summed per slot before the
    softmax, and the value accumulators keep one ``[GQ_PAD, G/4]`` block per (slot, group). Quarter ``j`` of
    the query ``q_j [GQ_PAD, Q4]`` holds the elements :func:`field_cols` ``(c, j)``, so column ``g·G/4 + c'``
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
    # uniform codes arrive as c·4^j·2^-24 (field_scaled): the same powers of two as the G == D path
    if KEY_BITS == 4:  # nibbles arrive as c·16^n·2^-24 (nibble_scaled): quarters 2, 3 are high nibbles
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
    w0 = field_cols(m2, 0, G, Q4) // 2
    w1 = field_cols(m2, 1, G, Q4) // 2
    w2 = field_cols(m2, 2, G, Q4) // 2
    w3 = field_cols(m2, 3, G, Q4) // 2
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
                st_ = tl.dot(nibble_scaled(ka, 0, FAST_UNPACK), tl.permute((qc0 * ks0).to(tl.float16), (0, 2, 1)))
                st_ = tl.dot(nibble_scaled(kb, 0, FAST_UNPACK), tl.permute((qc1 * ks1).to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(nibble_scaled(ka, 1, FAST_UNPACK), tl.permute((qc2 * ks2).to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(nibble_scaled(kb, 1, FAST_UNPACK), tl.permute((qc3 * ks3).to(tl.float16), (0, 2, 1)), st_)
            else:
                st_ = tl.dot(field_scaled(kc, 0, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute((qc0 * ks0).to(tl.float16), (0, 2, 1)))
                st_ = tl.dot(field_scaled(kc, 1, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute((qc1 * ks1).to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(field_scaled(kc, 2, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
                             tl.permute((qc2 * ks2).to(tl.float16), (0, 2, 1)), st_)
                st_ = tl.dot(field_scaled(kc, 3, kl0, kl1, kl2, kl3, K_CODEBOOK, FAST_UNPACK),
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
                kb = ka  # unread by key_scores' 2-bit path
            ks, klo = _group_params(k_params_ptr, word_off[:, None, None] + wtile, ok[:, None, None])  # [NB, NG, P]
            ks = tl.reshape(ks, (NBG, P))
            klo = tl.reshape(klo, (NBG, P))
            # scores transposed per (slot, group): [NBG, P, GQ_PAD], summed over the groups of each slot
            st_ = key_scores(ka, kb, qt0, qt1, qt2, qt3, kl0, kl1, kl2, kl3, KEY_BITS, K_CODEBOOK, FAST_UNPACK)
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
        b0 = tl.dot(ps, field_scaled(vc, 0, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b0 * ag)
        b1 = tl.dot(ps, field_scaled(vc, 1, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b1 * ag)
        b2 = tl.dot(ps, field_scaled(vc, 2, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b2 * ag)
        b3 = tl.dot(ps, field_scaled(vc, 3, vl0, vl1, vl2, vl3, V_CODEBOOK, FAST_UNPACK), b3 * ag)
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


hash_bottom_up(globals())  # one Triton cache key per helper, whatever kernel launches first (cache_keys.py)

__all__ = ["grouped_pages"]
