"""The ``"portable"`` decode backend (linear pages, any CUDA GPU): the Triton twin of ``reference.decode_attention``.

One softmax over each sequence's BF16 sink, its INT2 pages and its BF16 recent window, in two launches:

1. ``decode_split_kernel``, grid ``(B * H_kv, S)``: program ``(b, h, s)`` takes the ``GQ = H / H_kv`` query
   heads of KV head ``h`` together (tensor-core ``tl.dot`` s, so every cache byte is read once) over one
   piece of the context. Split ``s < S_pages`` streams ``pages_per_split`` INT2 pages, ``NB`` pages per
   loop iteration on the batch axis of 3-D dots (one page per warp: ``num_warps == NB``, so the row max and
   sum stay inside a warp), each page slot with its own online softmax, combined after the loop. The
   remaining splits take one ``BN``-token chunk of the sink or of the recent window each. It writes the
   normalised partial output and its log2-sum-exp.
2. ``merge_kernel`` (``decode/splits.py``), grid ``(B * H,)``: combines the splits by their log-sum-exp.

The affine dequantization never touches the inner loop (docs/design.md §3.1): with ``k̂ = lo + s·lev[c]``,
``q·k̂ = s·(q·lev[c]) + lo·Σq`` per row (token keys) or ``Σ_i (q_i s_i)·lev[c_i] + Σ_i q_i lo_i`` (keys per
channel within a page: the query is scaled once per page), and ``Σ_t p_t v̂_t = Σ_t (p_t s_t)·lev[c_t] + Σ_t
p_t lo_t``. The four 2-bit fields of a code byte belong to the four quarters of the row (``layout.py``
packing), so quarter ``j`` of the query meets field ``j`` of the bytes and the output comes out as four
quarter accumulators. Per element only the field extraction remains: uniform codes become exact fp16
*subnormals* ``c·4^j·2^-24`` with three PTX instructions per four codes (the powers of two are folded into
the query, the key scale and the value quarters). 4-bit key pages (``KEY_BITS == 4``, uniform levels 0..15)
hold ``D/2`` bytes a row: bytes ``g G/2 + c`` and ``g G/2 + G/4 + c`` carry quarters 0 | 2 and 1 | 3 of the
same position in their low | high nibbles, so the same query quarters meet two ``[P, D/4]`` byte tiles, a
nibble masked in place becoming the subnormal ``c·16^n·2^-24`` (:func:`nibble_scaled`); the 2-bit path is a
separate constexpr branch and compiles as before. Scores are computed transposed (``S^T = K·q^T``: the
keys are the MMA's M operand, GQ sits on N), the per-token ``(scale, lo)`` pairs are read as 32-bit words so
the pipeliner prefetches them with the codes. How each of these was chosen, with H200 numbers, is in
``docs/kernels.md``.

Dot operands are fp16 (accumulation fp32): codes and levels, the BF16 window values (exact in fp16
within its range, |x| < 65504) and ``q·sm_scale·log2(e)``, ``p`` and ``p·s`` (11-bit mantissa, finer
than BF16). fp16 rather than BF16 also because Triton's CPU interpreter (3.9) computes BF16 dots wrongly,
and the CPU tests must run the same arithmetic as the GPU. The error budget in the tests is stated against
a BF16 PyTorch computation of the same attention. ``sm_scale`` is a compile-time constant (no fp32
runtime scalars: docs/design.md §3.5), the page table is int32, the wrapper never reads device values (no host
synchronisation), so a decode step is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..aot import launch_plan as _plan
from ..cache_keys import hash_bottom_up
from ..checks import check_decode_inputs, check_portable_layout
from ..layout import KVCacheLayout, PagedKV

# the split kernel's own helpers, called by these names in its body
from .portable_grouped import grouped_pages
from .portable_pages import field_cols, softmax_step, window_block
from .portable_rows import row_pages
from .splits import launch_split_merge, sm_count

LOG2E = 1.4426950408889634
#: INT2 pages per loop iteration and warps/stages of the split kernel (one page per warp; fastest measured on the
#: H200): the JIT wrapper's defaults, stated once, in the launch plan (kernels/aot/launch_plan.py).
PAGE_SLOTS = _plan.PAGE_SLOTS
SPLIT_WARPS = _plan.DECODE_SPLIT.num_warps
SPLIT_STAGES = _plan.DECODE_SPLIT.num_stages


@triton.jit
def decode_split_kernel(
    q_ptr,
    sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
    k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
    block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
    part_o_ptr, part_lse_ptr,
    max_pages, pages_per_split, n_page_splits, n_splits,
    H_KV: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    P: tl.constexpr, S0: tl.constexpr, RC: tl.constexpr, BN: tl.constexpr, SM_SCALE: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_CODEBOOK: tl.constexpr, V_CODEBOOK: tl.constexpr,
    FAST_UNPACK: tl.constexpr, NB: tl.constexpr, KEY_BITS: tl.constexpr,
):
    """Partial attention of one (sequence, KV head, split). Grid ``(B * H_kv, n_splits)``.

    Parameters (in order; pointers unless noted):
        q_ptr         ``[B, H, D]`` queries in the stored key basis (fp32/bf16/fp16, contiguous): the step's
                      rotation, once a step (``decode_step.decode_append(q=...)``), never in a split program
        sink_k_ptr, sink_v_ptr       bf16 ``[B, H_kv, S0, D]``
        recent_k_ptr, recent_v_ptr   bf16 ``[B, H_kv, RC, D]`` rings (RC = layout.recent_slots = W + 2P)
        k_codes_ptr, v_codes_ptr     uint8 ``[N_pool, H_kv, P, D * KEY_BITS / 8]``, ``[N_pool, H_kv, P, D // 4]``
        k_params_ptr  fp16 ``[N_pool, H_kv, P, D // G, 2]`` (token) or ``[N_pool, H_kv, 2, D]`` (K_CHANNEL)
        v_params_ptr  fp16 ``[N_pool, H_kv, P, D // G, 2]``
        k_levels_ptr, v_levels_ptr   fp32 ``[H_kv, 4]``
        block_table_ptr int32 ``[B, max_pages]``; sink_len_ptr, num_pages_ptr, recent_len_ptr int32 ``[B]``
        part_o_ptr    fp32 ``[B, H, n_splits, D]``; part_lse_ptr fp32 ``[B, H, n_splits]`` (log2 units)
        max_pages, pages_per_split, n_page_splits, n_splits: int32
        constexpr: H_KV, GQ (= H / H_kv), GQ_PAD (pow2 >= max(GQ, 4)), D, G (token group size of keys and
        values; ``D // G`` groups per row, see :func:`grouped_pages`), P, S0, RC, BN (BF16 chunk),
        SM_SCALE (float), K_CHANNEL, K_CODEBOOK, V_CODEBOOK, FAST_UNPACK (PTX field extraction of
        uniform codes, not with codebooks; CUDA only, the CPU interpreter takes the plain path), NB (pow2,
        INT2 pages per loop iteration; one per warp with ``num_warps == NB``), KEY_BITS (``layout.key.bits``: 2, or
        4 with uniform levels, ``k_levels_ptr`` then unread; values are 2-bit).
    A page split takes :func:`row_pages` (``portable_rows.py``) with ``G == D``, one (scale, lo) per token row, and
    :func:`grouped_pages` (``portable_grouped.py``) with ``G < D``. Field ``j`` of code byte ``c`` is row element
    :func:`field_cols` ``(c, j)``: the query quarters, the BF16 loads and the output quarters use the same element
    map, so every part of the split agrees.
    """
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H_KV
    h = bh % H_KV
    H: tl.constexpr = H_KV * GQ
    Q4: tl.constexpr = D // 4
    g = tl.arange(0, GQ_PAD)
    gmask = g < GQ
    c4 = tl.arange(0, Q4)
    # row elements of the four code-byte fields (j * Q4 + c4 for one group per row)
    e0 = field_cols(c4, 0, G, Q4)
    e1 = field_cols(c4, 1, G, Q4)
    e2 = field_cols(c4, 2, G, Q4)
    e3 = field_cols(c4, 3, G, Q4)
    qrow = (b * H + h * GQ + g).to(tl.int64) * D
    qp = q_ptr + qrow[:, None]
    q0 = tl.load(qp + e0[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(qp + e1[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qp + e2[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(qp + e3[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    qscale: tl.constexpr = SM_SCALE * 1.4426950408889634
    q0 = (q0 * qscale).to(tl.float16)
    q1 = (q1 * qscale).to(tl.float16)
    q2 = (q2 * qscale).to(tl.float16)
    q3 = (q3 * qscale).to(tl.float16)
    m = tl.full([GQ_PAD], float("-inf"), tl.float32)
    den = tl.zeros([GQ_PAD], tl.float32)
    acc0 = tl.zeros([GQ_PAD, Q4], tl.float32)
    acc1 = tl.zeros([GQ_PAD, Q4], tl.float32)
    acc2 = tl.zeros([GQ_PAD, Q4], tl.float32)
    acc3 = tl.zeros([GQ_PAD, Q4], tl.float32)
    # the value lows: one per query head (G == D) or per head and output column (G < D: per group)
    LO_W: tl.constexpr = 1 if G == D else Q4
    acclo = tl.zeros([GQ_PAD, LO_W], tl.float32)
    if s < n_page_splits:
        if G < D:
            m, den, acc0, acc1, acc2, acc3, acclo = grouped_pages(
                q0, q1, q2, q3, k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
                block_table_ptr, num_pages_ptr, b, h, s, max_pages, pages_per_split,
                H_KV, GQ_PAD, D, G, P, K_CHANNEL, K_CODEBOOK, V_CODEBOOK, FAST_UNPACK, NB, KEY_BITS)
        else:
            m, den, acc0, acc1, acc2, acc3, acclo = row_pages(
                q0, q1, q2, q3, k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
                block_table_ptr, num_pages_ptr, b, h, s, max_pages, pages_per_split,
                H_KV, GQ_PAD, D, P, K_CHANNEL, K_CODEBOOK, V_CODEBOOK, FAST_UNPACK, NB, KEY_BITS)
    else:
        tb = tl.arange(0, BN)
        kb, vb, tmask = window_block(sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr, num_pages_ptr,
                                     recent_len_ptr, b, h, s - n_page_splits, tb, H_KV, D, P, S0, RC, BN)
        rows = tb[:, None] * D
        kk = kb + rows
        scb = tl.dot(q0, tl.trans(tl.load(kk + e0[None, :], mask=tmask[:, None], other=0.0).to(tl.float16)))
        scb = tl.dot(q1, tl.trans(tl.load(kk + e1[None, :], mask=tmask[:, None], other=0.0).to(tl.float16)), scb)
        scb = tl.dot(q2, tl.trans(tl.load(kk + e2[None, :], mask=tmask[:, None], other=0.0).to(tl.float16)), scb)
        scb = tl.dot(q3, tl.trans(tl.load(kk + e3[None, :], mask=tmask[:, None], other=0.0).to(tl.float16)), scb)
        scb = tl.where(tmask[None, :], scb, float("-inf"))
        pw, alpha, m, den = softmax_step(scb, m, den)
        pb = pw.to(tl.float16)
        vv = vb + rows
        acc0 = tl.dot(pb, tl.load(vv + e0[None, :], mask=tmask[:, None], other=0.0).to(tl.float16))
        acc1 = tl.dot(pb, tl.load(vv + e1[None, :], mask=tmask[:, None], other=0.0).to(tl.float16))
        acc2 = tl.dot(pb, tl.load(vv + e2[None, :], mask=tmask[:, None], other=0.0).to(tl.float16))
        acc3 = tl.dot(pb, tl.load(vv + e3[None, :], mask=tmask[:, None], other=0.0).to(tl.float16))
    nonempty = den > 0.0
    inv = tl.where(nonempty, 1.0 / den, 0.0)
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, den, 1.0)), float("-inf"))
    prow = ((b * H + h * GQ + g).to(tl.int64) * n_splits + s)
    tl.store(part_lse_ptr + prow, lse, mask=gmask)
    po = part_o_ptr + prow[:, None] * D
    tl.store(po + e0[None, :], (acc0 + acclo) * inv[:, None], mask=gmask[:, None])
    tl.store(po + e1[None, :], (acc1 + acclo) * inv[:, None], mask=gmask[:, None])
    tl.store(po + e2[None, :], (acc2 + acclo) * inv[:, None], mask=gmask[:, None])
    tl.store(po + e3[None, :], (acc3 + acclo) * inv[:, None], mask=gmask[:, None])


# ---- wrapper ------------------------------------------------------------------------------------------------


def default_pages_per_split(batch: int, num_kv_heads: int, max_pages: int, num_sms: int = 132,
                            page_slots: int = PAGE_SLOTS) -> int:
    """Pages per split so that ``B * H_kv * splits`` fills ``num_sms`` about four times over, rounded up to a
    multiple of ``page_slots`` (the pages one loop iteration takes)."""
    wanted = max(1, -(-4 * num_sms // max(1, batch * num_kv_heads)))
    pps = max(1, -(-max_pages // wanted))
    return -(-pps // page_slots) * page_slots


def decode_attention(
    q: torch.Tensor,
    state: PagedKV,
    layout: KVCacheLayout,
    k_levels: torch.Tensor,
    v_levels: torch.Tensor,
    scale: float,
    *,
    codebook: bool | None = None,
    out_dtype: torch.dtype = torch.float32,
    pages_per_split: int | None = None,
    page_slots: int = PAGE_SLOTS,
    num_warps: int = SPLIT_WARPS,
    num_stages: int = SPLIT_STAGES,
    fast_unpack: bool | None = None,
) -> torch.Tensor:
    """``reference.decode_attention`` in two Triton launches (split, merge).

    Args:
        q: ``[B, H, D]`` fp32/bf16/fp16 queries in the stored key basis (``decode_step.decode_append(q=...)`` or
            ``decode_step.rotate_queries``: the rotation once a step, never in a split program).
        state: the layer's cache (new token appended); BF16 windows, contiguous.
        k_levels, v_levels: ``[H_kv, 4]`` fp32 code levels.
        scale: softmax scale (a compile-time constant of the kernel).
        codebook: treat levels as a fitted codebook (default: ``layout.key/value.codebook``).
        pages_per_split: INT2 pages per split program (default: fill the GPU, :func:`default_pages_per_split`).
        page_slots, num_warps, num_stages: tuning (pages per loop iteration, a power of two; Triton's
            options). The defaults are the fastest measured on the H200 and what the AOT bundle compiles.
        fast_unpack: PTX field extraction for uniform levels (default: on CUDA); False forces the plain path.
    Returns:
        ``[B, H, D]`` in ``out_dtype``, stored value basis. Reads no device value on the host.
    """
    if page_slots <= 0 or page_slots & (page_slots - 1):
        raise ValueError(f"page_slots: expected a power of two, got {page_slots}")
    pages_per_split = checked_pages_per_split(q, state, layout, k_levels, v_levels, scale, out_dtype,
                                              pages_per_split, page_slots)
    dev = q.device
    if codebook is None:
        codebook = layout.key.codebook or layout.value.codebook
    fast = dev.type == "cuda" if fast_unpack is None else fast_unpack  # the plan turns it off for a codebook
    return launch_decode(
        q, state.sink_k, state.sink_v, state.recent_k, state.recent_v, state.k_codes, state.k_params,
        state.v_codes, state.v_params, k_levels, v_levels, state.block_table, state.sink_len, state.num_pages,
        state.recent_len, layout.num_kv_heads, layout.page_size, layout.sink, layout.recent_slots, float(scale),
        layout.key.granularity == "channel", bool(codebook), fast, pages_per_split, out_dtype, num_warps,
        num_stages, page_slots=page_slots, group_size=layout.value.group_size, key_bits=layout.key.bits,
    )


def checked_pages_per_split(
    q: torch.Tensor, state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor,
    scale: float, out_dtype: torch.dtype, pages_per_split: int | None, page_slots: int = PAGE_SLOTS,
) -> int:
    """Every check of a launch of this kernel (``checks.check_portable_layout``, ``checks.check_decode_inputs``);
    returns ``pages_per_split``, None filled in by :func:`default_pages_per_split` on ``q``'s GPU (132 SMs off the
    GPU). Reads shapes only, never device values."""
    check_portable_layout(layout)
    check_decode_inputs(q, state, layout, k_levels, v_levels, scale, out_dtype, pages_per_split)
    if pages_per_split is not None:
        return pages_per_split
    return default_pages_per_split(q.shape[0], layout.num_kv_heads, state.block_table.shape[1], sm_count(q.device),
                                   page_slots)


def launch_decode(
    q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
    block_table, sink_len, num_pages, recent_len, num_kv_heads: int, page_size: int, sink: int,
    recent_slots: int, scale: float, k_channel: bool, codebook: bool, fast_unpack: bool,
    pages_per_split: int, out_dtype: torch.dtype, num_warps: int = SPLIT_WARPS, num_stages: int = SPLIT_STAGES,
    wrap=lambda k: k, page_slots: int = PAGE_SLOTS, group_size: int | None = None, key_bits: int = 2,
) -> torch.Tensor:
    """Allocate the partials and launch split + merge on validated inputs (:func:`decode_attention` checks).

    ``group_size``: the layout's value (= token key) group size G; None means ``G = D``. ``key_bits``:
    ``layout.key.bits`` (the K pool holds ``D * key_bits / 8`` bytes a row).

    ``wrap`` wraps each kernel before launch (``torch.library.wrap_triton`` in :mod:`.triton_ops`). Grids:
    :func:`launch_split_merge`.
    """
    _, hq, d = q.shape
    constexprs = _plan.portable_split_constexprs(
        num_kv_heads, hq // num_kv_heads, d, page_size, sink, recent_slots, k_channel, key_bits,
        group_size=group_size or d, sm_scale=scale, codebook=codebook, fast_unpack=fast_unpack, page_slots=page_slots)
    return launch_split_merge(
        decode_split_kernel, _plan.DECODE_SPLIT, q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes,
        v_params, k_levels, v_levels, block_table, sink_len, num_pages, recent_len, pages_per_split, out_dtype,
        constexprs, num_warps, num_stages, wrap,
    )



hash_bottom_up(globals())  # one Triton cache key per kernel, whatever launches first (cache_keys.py)

__all__ = [
    "PAGE_SLOTS", "SPLIT_STAGES", "SPLIT_WARPS", "checked_pages_per_split", "decode_attention", "decode_split_kernel",
    "default_pages_per_split", "launch_decode"
]
