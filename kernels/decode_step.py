"""One decode step's cache update on the GPU: the Triton twin of ``reference.append_tokens`` for one token.

Two launches that read no device value on the host, so a decode step is capturable in a CUDA graph:

1. ``_demote_due_kernel``, grid ``(B, H_kv)``: for each sequence whose recent window is full, quantize its
   oldest ``P`` recent tokens into the page the caller reserved (the :mod:`.quant_pack` quantizer, bit-exact
   with the reference) and shift the window left by ``P``.
2. ``_append_kernel``, grid ``(B,)``: write the new token into the sink or the recent window and update the
   counters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import launch_plan as _plan
from .layout import KVCacheLayout, PagedKV
from .quant_pack import _check, _quantize_page, _round_bf16, check_format, check_paged_state, removal_counts
from .transform import LayerTransform

#: warps of the two launches: stated once, in the launch plan (kernels/aot/launch_plan.py).
DEMOTE_WARPS = _plan.DEMOTE_DUE.num_warps
APPEND_WARPS = _plan.APPEND.num_warps


@triton.jit
def _demote_due_kernel(
    recent_k_ptr, recent_v_ptr, k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr,
    k_rank_ptr, v_rank_ptr, k_levels_ptr, v_levels_ptr, block_table_ptr, num_pages_ptr, recent_len_ptr,
    max_pages,
    H_KV: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, RC: tl.constexpr,
    K_CHANNEL: tl.constexpr,
):
    """Demotion step of a decode step, for sequences whose recent window is full. Grid ``(B, H_kv)``.

    If ``recent_len[b] == RC`` (= W + P): quantize recent slots ``[0, P)`` of KV head ``h`` into pool page
    ``block_table[b, num_pages[b]]`` (the caller reserved it) and shift slots ``[P, RC)`` to ``[0, RC - P)``.
    Counters are left alone (``_append_kernel`` updates them after every head is done).

    Parameters: recent_k_ptr, recent_v_ptr bf16 ``[B, H_kv, RC, D]``; k/v codes and params: the pools;
    k_rank_ptr, v_rank_ptr int32 ``[H_kv]`` removals per group; k_levels_ptr, v_levels_ptr fp32 ``[H_kv, 4]``;
    block_table_ptr int32 ``[B, max_pages]``; num_pages_ptr, recent_len_ptr int32 ``[B]``; max_pages int32;
    constexpr H_KV, P, D, G (value/token group size), RC, K_CHANNEL.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    if tl.load(recent_len_ptr + b) == RC:
        page = tl.load(block_table_ptr + b.to(tl.int64) * max_pages + tl.load(num_pages_ptr + b)).to(tl.int64)
        t = tl.arange(0, P)
        i = tl.arange(0, D)
        base = (b * H_KV + h).to(tl.int64) * (RC * D)
        rows = t[:, None] * D + i[None, :]
        _quantize_page(recent_k_ptr + base, D, k_codes_ptr, k_params_ptr, page * H_KV + h, tl.load(k_rank_ptr + h),
                       tl.load(k_levels_ptr + h * 4), tl.load(k_levels_ptr + h * 4 + 1),
                       tl.load(k_levels_ptr + h * 4 + 2), tl.load(k_levels_ptr + h * 4 + 3), P, D, G, K_CHANNEL)
        _quantize_page(recent_v_ptr + base, D, v_codes_ptr, v_params_ptr, page * H_KV + h, tl.load(v_rank_ptr + h),
                       tl.load(v_levels_ptr + h * 4), tl.load(v_levels_ptr + h * 4 + 1),
                       tl.load(v_levels_ptr + h * 4 + 2), tl.load(v_levels_ptr + h * 4 + 3), P, D, G, False)
        tl.debug_barrier()  # every warp has read slots [0, P) before any overwrites them
        # shift left by P, one page-sized block at a time in ascending order (reads stay ahead of writes)
        for blk in range(0, RC // P - 1):
            src = base + (blk + 1) * (P * D) + rows
            dst = base + blk * (P * D) + rows
            tl.store(recent_k_ptr + dst, tl.load(recent_k_ptr + src))
            tl.store(recent_v_ptr + dst, tl.load(recent_v_ptr + src))


@triton.jit
def _append_kernel(
    k_ptr, v_ptr, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
    sink_len_ptr, num_pages_ptr, recent_len_ptr,
    H_KV: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, S0: tl.constexpr,
    RC: tl.constexpr,
):
    """Write one new token per sequence and update the counters. Grid ``(B,)``; runs after the demotion.

    The token goes to the sink while the sequence is still filling it (``sink_len < S0`` and nothing
    after it), otherwise to recent slot ``recent_len`` (``recent_len - P`` when a demotion just happened).

    Parameters: k_ptr, v_ptr ``[B, H_kv, D]`` stored basis (fp32/bf16/fp16); sink_k/v bf16 ``[B, H_kv, S0, D]``;
    recent_k/v bf16 ``[B, H_kv, RC, D]``; sink_len_ptr, num_pages_ptr, recent_len_ptr int32 ``[B]``;
    constexpr H_KV, H_PAD (pow2 >= H_KV), D, P, S0, RC.
    """
    b = tl.program_id(0)
    hh = tl.arange(0, H_PAD)
    i = tl.arange(0, D)
    hm = (hh < H_KV)[:, None]
    src = (b * H_KV + hh).to(tl.int64)[:, None] * D + i[None, :]
    k = _round_bf16(tl.load(k_ptr + src, mask=hm, other=0.0).to(tl.float32))
    v = _round_bf16(tl.load(v_ptr + src, mask=hm, other=0.0).to(tl.float32))
    sl = tl.load(sink_len_ptr + b)
    npg = tl.load(num_pages_ptr + b)
    rl = tl.load(recent_len_ptr + b)
    if (sl < S0) & (npg == 0) & (rl == 0):
        dst = (b * H_KV + hh).to(tl.int64)[:, None] * (S0 * D) + sl * D + i[None, :]
        tl.store(sink_k_ptr + dst, k.to(tl.bfloat16), mask=hm)
        tl.store(sink_v_ptr + dst, v.to(tl.bfloat16), mask=hm)
        tl.store(sink_len_ptr + b, sl + 1)
    else:
        due = rl == RC
        r = tl.where(due, rl - P, rl)
        dst = (b * H_KV + hh).to(tl.int64)[:, None] * (RC * D) + r * D + i[None, :]
        tl.store(recent_k_ptr + dst, k.to(tl.bfloat16), mask=hm)
        tl.store(recent_v_ptr + dst, v.to(tl.bfloat16), mask=hm)
        tl.store(recent_len_ptr + b, r + 1)
        tl.store(num_pages_ptr + b, tl.where(due, npg + 1, npg))


# ---- wrapper ------------------------------------------------------------------------------------------------


def decode_step_update(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout, transform: LayerTransform
) -> None:
    """Append one token to every sequence, demoting ``P`` recent tokens first where the window is full.

    The same cache as ``reference.append_tokens`` with ``T = 1`` for each ``b``, in two launches that read no
    device value on the host (CUDA-graph capturable). Contract (not checked, it would need a host sync):
    wherever a demotion can be due, ``block_table[b, num_pages[b]]`` holds a free page the caller reserved,
    and ``num_pages[b] < max_pages``. New rows are not checked for NaN/Inf (the reference does).

    Args:
        k, v: ``[B, H_kv, D]`` fp32/bf16/fp16 new rows in the stored basis.
        transform: clip ratios and levels (``k_clip, v_clip, k_levels, v_levels``).
    """
    check_decode_step_inputs(state, k, v, layout, transform)
    h, d, p = layout.num_kv_heads, layout.head_dim, layout.page_size
    bsz = k.shape[0]
    max_pages = state.block_table.shape[1]
    tr = transform
    k_group = p if layout.key.granularity == "channel" else layout.key.group_size
    _demote_due_kernel[(bsz, h)](
        state.recent_k, state.recent_v, state.k_codes, state.k_params, state.v_codes, state.v_params,
        removal_counts(tr.k_clip, k_group), removal_counts(tr.v_clip, layout.value.group_size),
        tr.k_levels.contiguous(), tr.v_levels.contiguous(), state.block_table, state.num_pages, state.recent_len,
        max_pages,
        H_KV=h, P=p, D=d, G=layout.value.group_size, RC=layout.recent_capacity,
        K_CHANNEL=layout.key.granularity == "channel", num_warps=4,
    )
    _append_kernel[(bsz,)](
        k, v, state.sink_k, state.sink_v, state.recent_k, state.recent_v,
        state.sink_len, state.num_pages, state.recent_len,
        H_KV=h, H_PAD=1 << max(0, (h - 1).bit_length()), D=d, P=p, S0=layout.sink, RC=layout.recent_capacity,
        num_warps=4,
    )


def check_decode_step_inputs(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout, transform: LayerTransform
) -> None:
    """Raise on anything :func:`decode_step_update` cannot launch on (shapes, dtypes, devices only)."""
    h, d, p = layout.num_kv_heads, layout.head_dim, layout.page_size
    check_format(layout.key, p, "decode_step_update key")
    check_format(layout.value, p, "decode_step_update value")
    if layout.recent_capacity % p:
        raise NotImplementedError(f"decode_step_update: window + page must be a multiple of P={p}")
    if k.dim() != 3:
        raise ValueError(f"k: expected [B, H_kv, D], got {list(k.shape)}")
    bsz = k.shape[0]
    dev = k.device
    for name, t in (("k", k), ("v", v)):
        _check(name, t, (bsz, h, d), (torch.float32, torch.bfloat16, torch.float16), dev)
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    check_paged_state(state, layout, bsz, dev)
    tr = transform
    for name, t, shape in (("k_clip", tr.k_clip, (h,)), ("v_clip", tr.v_clip, (h,)),
                           ("k_levels", tr.k_levels, (h, 4)), ("v_levels", tr.v_levels, (h, 4))):
        _check(f"transform.{name}", t, shape, torch.float32, dev)
    if layout.key.granularity == "token" and layout.key.group_size != layout.value.group_size:
        raise NotImplementedError("decode_step_update: key and value token group sizes must match")


__all__ = ["check_decode_step_inputs", "decode_step_update"]
