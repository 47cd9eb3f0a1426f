"""The decode step's cache write on the GPU: the Triton twin of ``reference.decode_append``, one launch.

``_decode_append_kernel``, grid ``(B, H_kv, D / CB)``: program ``(b, h, c)`` owns columns ``c CB .. (c + 1) CB``
of token ``b``'s row of KV head ``h`` (``CB``: ``launch_plan.append_columns``, 16 at head_dim 128: 8 programs a head)

1. turns the new key into the stored basis, ``k_s = (k @ R_K[h]) * d_K[h] - mu_K[h]`` (``TRANSFORM``; fp32
   FMAs, then rounded to BF16 as the window stores it) and the value into ``v_s = v - mu_V[h]`` (the value
   rotation is folded into the exported ``v_proj``, or applied by the caller); with ``ROTATE_Q`` it also writes
   the step's queries of KV head ``h`` in the stored key basis, ``q_s = (q @ R_K[h]) / d_K[h]`` (fp32): the query
   rotation once a step (docs/design.md §3.6), from the same ``R_K[h][:, cols]`` (one ``[D, CB]`` load a
   program, read once for both products), so the decode attention kernels read ``q_s`` and none of their split
   programs rotates;
2. skips everything if the slot's step status is set or the token is not finite in any KV head (then it
   sets ``STATUS_NONFINITE`` in ``status[b]``; every program checks every head's whole input rows, so no
   column of any head of such a token is written, whatever order the programs run in; a key whose transform
   overflows from finite inputs is caught by the programs of the columns it overflows in, which set the status,
   while the others may write their columns: beyond the committed lengths, in a step the book does not commit);
3. if the recent ring is full (``recent_len == W + P``), quantizes page ``n = num_pages[b]``'s ring rows
   ``(nP + j) mod C`` into pool page ``block_table[b, n]`` (the :mod:`.quant_pack` quantizer, bit-exact with
   the reference; ``K_BITS``-bit key codes, 4 for the layers with wider keys), moving nothing: the keys in
   program ``c = 0``, the values in the last one (:func:`_demote`, a function of its own in the compiled kernel);
4. writes its columns of the token into sink slot ``sink_len`` (sink not full) or ring slot
   ``(nP + recent_len) mod C`` (never one of the page's being demoted).

Every load a program makes (status, lengths, inputs, ``R_K``) depends on no other, so the step that demotes
nothing costs about one memory round trip. Lengths are read, never written: the page book commits them once
per step (:mod:`.pages`). Every write lands beyond the committed lengths, so a step that is not committed left
no trace. Nothing is read back on the host: the launch is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import launch_plan as _plan
from .cache_keys import hash_bottom_up
from .checks import check_decode_append_inputs
from .layout import KVCacheLayout, PagedKV, packing_code
from .quant_pack import quantize_page, removal_counts, round_bf16
from .transform import LayerTransform


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) < float("inf"))


@triton.jit
def _decode_append_kernel(
    k_ptr, v_ptr, q_ptr, q_rot_ptr, rot_ptr, kscale_ptr, kmean_ptr, vmean_ptr,
    sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
    k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr,
    k_rank_ptr, v_rank_ptr, k_levels_ptr, v_levels_ptr,
    block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr, status_ptr,
    max_pages,
    H_KV: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, S0: tl.constexpr,
    C: tl.constexpr, RCAP: tl.constexpr, K_CHANNEL: tl.constexpr, TRANSFORM: tl.constexpr,
    CB: tl.constexpr, NONFINITE: tl.constexpr, K_PACKING: tl.constexpr, V_PACKING: tl.constexpr,
    K_BITS: tl.constexpr, GQ: tl.constexpr, ROTATE_Q: tl.constexpr,
):
    """Columns ``c CB .. (c + 1) CB`` of one token of one (sequence, KV head). Grid ``(B, H_kv, D // CB)``.

    Parameters (in order): k_ptr, v_ptr ``[B, H_kv, D]`` new rows (fp32/bf16/fp16; keys post-RoPE in the
    model basis if TRANSFORM, else already stored-basis; values with the rotation applied); q_ptr ``[B, H_kv * GQ,
    D]`` the step's queries in the model basis and q_rot_ptr fp32 ``[B, H_kv * GQ, D]`` their stored-basis
    rotation (read / written iff ROTATE_Q, whatever the status: attention runs for every row); rot_ptr fp32
    ``[H_kv, D, D]`` R_K, kscale_ptr/kmean_ptr/vmean_ptr fp32 ``[H_kv, D]`` (read iff TRANSFORM; R_K and d_K also
    with ROTATE_Q); sink_k/v bf16 ``[B, H_kv, S0, D]``; recent_k/v bf16 ``[B, H_kv, C, D]`` rings; k/v codes and
    params: the pools; k_rank_ptr, v_rank_ptr int32 ``[H_kv]`` removals per group; k_levels_ptr, v_levels_ptr fp32
    ``[H_kv, 4]``; block_table_ptr int32 ``[B, max_pages]``; sink_len/num_pages/recent_len int32 ``[B]`` committed
    lengths; status_ptr int32 ``[B]`` step status (read; NONFINITE or-ed in); max_pages int32;
    constexpr H_KV, P, D, G (value/token group size), S0, C (ring slots W + 2P), RCAP (W + P), K_CHANNEL,
    TRANSFORM, CB (columns a program: ``launch_plan.append_columns``), NONFINITE (the status bit), K_PACKING /
    V_PACKING (``layout.packing_code`` of each pool), K_BITS (``layout.key.bits``: 2, or 4 with uniform levels;
    values are 2-bit), GQ (query heads per KV head), ROTATE_Q.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    NCB: tl.constexpr = D // CB
    i = tl.arange(0, D)
    j = c * CB + tl.arange(0, CB)  # this program's columns
    row = (b * H_KV + h).to(tl.int64) * D
    HP: tl.constexpr = triton.next_power_of_2(H_KV)
    hh = tl.arange(0, HP)
    rows = (b * H_KV + hh).to(tl.int64)[:, None] * D + i[None, :]  # every KV head's row of this token
    heads = (hh < H_KV)[:, None]
    # every load first: none depends on another. The transform's (HBM: a step's weights flush the L2) before the
    # step's inputs (just written, L2), and those whose layout changes for a product last: a layout change goes
    # through shared memory behind a barrier, and no load issued after it leaves before the data of the load
    # before it has come
    if TRANSFORM or ROTATE_Q:
        rot = tl.load(rot_ptr + h * (D * D) + i[:, None] * D + j[None, :])  # [D, CB] fp32: R_K[h][:, j]
        dk = tl.load(kscale_ptr + h * D + j)
    if TRANSFORM:
        mk = tl.load(kmean_ptr + h * D + j)
        mv = tl.load(vmean_ptr + h * D + j)
    status = tl.load(status_ptr + b)
    sl = tl.load(sink_len_ptr + b)
    npg = tl.load(num_pages_ptr + b)
    rl = tl.load(recent_len_ptr + b)
    k_all = tl.load(k_ptr + rows, mask=heads, other=0.0).to(tl.float32)  # [HP, D]
    v_all = tl.load(v_ptr + rows, mask=heads, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row + j).to(tl.float32)
    if TRANSFORM:
        v = v - mv
        kin = tl.load(k_ptr + row + i).to(tl.float32)  # [D]
    else:
        k = tl.load(k_ptr + row + j).to(tl.float32)
    if ROTATE_Q:
        GQ_PAD: tl.constexpr = triton.next_power_of_2(GQ)
        g = tl.arange(0, GQ_PAD)
        qrow = (b * (H_KV * GQ) + h * GQ + g).to(tl.int64) * D  # [GQ_PAD]
        gmask = (g < GQ)[:, None]
        qb = tl.load(q_ptr + qrow[:, None] + i[None, :], mask=gmask, other=0.0).to(tl.float32)  # [GQ_PAD, D]
        # q_rot[b, h GQ + g, j] = (q[b, h GQ + g] @ R_K[h])[j] / d_K[h, j]
        qs = tl.sum(qb[:, :, None] * rot[None, :, :], axis=1) / dk[None, :]  # [GQ_PAD, CB]
        tl.store(q_rot_ptr + qrow[:, None] + j[None, :], qs, mask=gmask)
    if TRANSFORM:
        k = tl.sum(kin[:, None] * rot, axis=0) * dk - mk
    # finite before rounding (rounding NaN bits is meaningless) and after (a huge finite value rounds to inf);
    # every program also checks every head's whole input rows, so a token with a NaN in any head writes no head
    k16 = round_bf16(k)
    v16 = round_bf16(v)
    fin = _finite(k) & _finite(v) & _finite(k16) & _finite(v16)
    others = _finite(k_all) & _finite(v_all)
    finite = (tl.sum(fin.to(tl.int32), axis=0) == CB) & (tl.sum(tl.sum(others.to(tl.int32), axis=1), axis=0) == HP * D)
    if not finite:
        tl.atomic_or(status_ptr + b, NONFINITE)
    if (status == 0) & finite:
        if sl < S0:
            dst = (b * H_KV + h).to(tl.int64) * (S0 * D) + sl * D + j
            tl.store(sink_k_ptr + dst, k16.to(tl.bfloat16))
            tl.store(sink_v_ptr + dst, v16.to(tl.bfloat16))
        else:
            ring = (b * H_KV + h).to(tl.int64) * (C * D)
            if rl == RCAP:  # demote page npg: its rows are ring slots (npg * P) mod C .. + P (C % P == 0), which
                # no program of this launch writes; the keys by the first program of the head, the values by the last
                page_head = tl.load(block_table_ptr + b.to(tl.int64) * max_pages + npg).to(tl.int64) * H_KV + h
                first = ring + ((npg * P) % C) * D
                if c == 0:
                    _demote(recent_k_ptr + first, k_codes_ptr, k_params_ptr, page_head, k_rank_ptr + h,
                            k_levels_ptr + h * 4, P, D, G, K_CHANNEL, K_PACKING, K_BITS)
                if c == NCB - 1:
                    _demote(recent_v_ptr + first, v_codes_ptr, v_params_ptr, page_head, v_rank_ptr + h,
                            v_levels_ptr + h * 4, P, D, G, False, V_PACKING, 2)
            dst = ring + ((npg * P + rl) % C) * D + j
            tl.store(recent_k_ptr + dst, k16.to(tl.bfloat16))
            tl.store(recent_v_ptr + dst, v16.to(tl.bfloat16))


@triton.jit(noinline=True)
def _demote(rows_ptr, codes_ptr, params_ptr, page_head, rank_ptr, levels_ptr, P: tl.constexpr, D: tl.constexpr,
            G: tl.constexpr, CHANNEL: tl.constexpr, PACKING: tl.constexpr, BITS: tl.constexpr):
    """Quantize the ring rows ``[P, D]`` at ``rows_ptr`` into page-head ``page_head``
    (:func:`.quant_pack.quantize_page` with the head's removals ``rank_ptr[0]`` and levels ``levels_ptr[0:4]``).
    Not inlined: the demotion is its own function in the compiled kernel, so Triton's coalescing pass (whose cost
    grows with the memory operations times the operations they connect to) sees two small functions instead of
    one large one."""
    quantize_page(rows_ptr, D, codes_ptr, params_ptr, page_head, tl.load(rank_ptr), tl.load(levels_ptr),
                   tl.load(levels_ptr + 1), tl.load(levels_ptr + 2), tl.load(levels_ptr + 3), P, D, G, CHANNEL,
                   PACKING, BITS)


# ---- wrapper ------------------------------------------------------------------------------------------------


def decode_append(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, *, fused_transform: bool = False,
    group_removals: tuple[torch.Tensor, torch.Tensor] | None = None, q: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``reference.decode_append`` in one launch that reads no device value on the host; with ``q``, the same
    launch also returns the step's queries in the stored key basis.

    Args:
        state: committed lengths (the page book's), BF16 windows, contiguous buffers.
        k, v: ``[B, H_kv, D]`` contiguous. With ``fused_transform`` the keys are post-RoPE in the model basis
            and the kernel applies ``(k @ R_K) * d_K - mu_K`` and ``v - mu_V`` (fp32 FMAs: not bit-identical
            to ``torch.matmul``); without it both are already in the stored basis (bit-exact with the
            reference).
        status: ``[B]`` int32 step status; see the module doc.
        group_removals: :func:`removals` of ``transform``, precomputed (a cache does it once per layer).
        q: ``[B, H, D]`` contiguous queries of the step in the model basis (post-RoPE), or None.
    Returns:
        With ``q``: ``[B, H, D]`` float32 ``transform.transform_queries(q)`` (fp32 FMAs in the kernel: equal to
        :func:`rotate_queries` up to the summation order), what the decode attention kernels take as their
        stored-basis query; else None.
    """
    check_decode_append_inputs(state, k, v, status, layout, transform, q)
    tr = transform
    k_rem, v_rem = group_removals if group_removals is not None else removals(layout, tr)
    q_rot = launch(
        k, v, k if q is None else q, tr.k_rotation, tr.k_scale, tr.k_mean, tr.v_mean,
        state.sink_k, state.sink_v, state.recent_k, state.recent_v,
        state.k_codes, state.k_params, state.v_codes, state.v_params, k_rem, v_rem, tr.k_levels, tr.v_levels,
        state.block_table, state.sink_len, state.num_pages, state.recent_len, status,
        layout.page_size, layout.sink, layout.recent_slots, layout.recent_capacity, layout.value.group_size,
        layout.key.granularity == "channel", fused_transform, packing_code(layout.key, "key"),
        packing_code(layout.value, "value"), layout.key.bits, q is not None,
    )
    return q_rot if q is not None else None


def launch(
    k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, k_rotation: torch.Tensor, k_scale: torch.Tensor,
    k_mean: torch.Tensor, v_mean: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, recent_k: torch.Tensor,
    recent_v: torch.Tensor, k_codes: torch.Tensor, k_params: torch.Tensor, v_codes: torch.Tensor,
    v_params: torch.Tensor, k_removals: torch.Tensor, v_removals: torch.Tensor, k_levels: torch.Tensor,
    v_levels: torch.Tensor, block_table: torch.Tensor, sink_len: torch.Tensor, num_pages: torch.Tensor,
    recent_len: torch.Tensor, status: torch.Tensor, page_size: int, sink: int, recent_slots: int,
    recent_capacity: int, group_size: int, k_channel: bool, fused_transform: bool, k_packing: int, v_packing: int,
    key_bits: int, rotate_q: bool,
) -> torch.Tensor:
    """The kernel's launch on checked inputs (:func:`check_decode_append_inputs`; ``oscar::decode_append`` calls it
    with the same arguments): grid ``(B, H_kv, D // CB)``. ``q`` is read iff ``rotate_q`` (any tensor otherwise).
    Returns the fresh fp32 stored-basis queries if ``rotate_q``, else an empty tensor."""
    bsz, h, d = k.shape
    cx = _plan.append_constexprs(h, d, group_size, page_size, sink, recent_slots, recent_capacity, k_channel, k_packing,
                                 v_packing, key_bits, fused_transform=fused_transform,
                                 gq=q.shape[1] // h if rotate_q else 1, rotate_q=rotate_q)
    q_rot = torch.empty(q.shape, dtype=torch.float32, device=q.device) if rotate_q else q.new_empty(0)
    plan = _plan.DECODE_APPEND
    _decode_append_kernel[plan.grid_for({"B": bsz}, cx)](
        k, v, q, q_rot if rotate_q else k,  # q_ptr, q_rot_ptr: read / written iff ROTATE_Q
        k_rotation, k_scale, k_mean, v_mean, sink_k, sink_v, recent_k, recent_v,
        k_codes, k_params, v_codes, v_params, k_removals, v_removals, k_levels, v_levels,
        block_table, sink_len, num_pages, recent_len, status, block_table.shape[1],
        **cx, num_warps=plan.num_warps,
    )
    return q_rot


def rotate_queries(q: torch.Tensor, transform: LayerTransform) -> torch.Tensor:
    """``[B, H, D]`` model-basis queries -> ``[B, H, D]`` float32 in the stored key basis, ``(q @ R_K) / d_K`` per KV
    head: one batched product (``LayerTransform.transform_queries``), the alternative to :func:`decode_append`'s
    fused rotation that ``benchmarks/bench_decode.py --step`` measures against it."""
    return transform.transform_queries(q.unsqueeze(2)).squeeze(2)


def removals(layout: KVCacheLayout, transform: LayerTransform) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``[H_kv]`` values each K / V quantization group drops before its max (from the clip ratios)."""
    k_group = layout.page_size if layout.key.granularity == "channel" else layout.key.group_size
    return removal_counts(transform.k_clip, k_group), removal_counts(transform.v_clip, layout.value.group_size)



hash_bottom_up(globals())  # one Triton cache key per kernel, whatever launches first (cache_keys.py)

__all__ = ["decode_append", "launch", "removals", "rotate_queries"]
