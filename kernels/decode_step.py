"""The decode step's cache write on the GPU: the Triton twin of ``reference.decode_append``, one launch.

``_decode_append_kernel``, grid ``(B, H_kv)``: program ``(b, h)``

1. turns the new key into the stored basis, ``k_s = (k @ R_K[h]) * d_K[h] - mu_K[h]`` (``TRANSFORM``; fp32
   FMAs, then rounded to BF16 as the window stores it) and the value into ``v_s = v - mu_V[h]`` (the value
   rotation is folded into the exported ``v_proj``, or applied by the caller); with ``ROTATE_Q`` it also writes
   the step's queries of KV head ``h`` in the stored key basis, ``q_s = (q @ R_K[h]) / d_K[h]`` (fp32): the query
   rotation once a step (docs/design.md §3.6), where ``R_K[h]`` is read anyway, so the decode attention kernels read
   ``q_s`` and none of their split programs rotates;
2. skips everything if the slot's step status is set or the token is not finite in any KV head (then it
   sets ``STATUS_NONFINITE`` in ``status[b]``; every program checks every head's input rows, so no head of
   such a token is written, whatever order the programs run in);
3. if the recent ring is full (``recent_len == W + P``), quantizes page ``n = num_pages[b]``'s ring rows
   ``(nP + j) mod C`` into pool page ``block_table[b, n]`` (the :mod:`.quant_pack` quantizer, bit-exact with
   the reference; ``K_BITS``-bit key codes, 4 for the layers with wider keys), moving nothing;
4. writes the token into sink slot ``sink_len`` (sink not full) or ring slot ``(nP + recent_len) mod C``.

Lengths are read, never written: the page book commits them once per step (:mod:`.pages`). Every write
lands beyond the committed lengths, so a step that is not committed left no trace. Nothing is read back
on the host: the launch is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import launch_plan as _plan
from .layout import KVCacheLayout, PagedKV, packing_code
from .pages import STATUS_NONFINITE
from .quant_pack import _check, _quantize_page, _round_bf16, check_format, check_paged_state, removal_counts
from .transform import LayerTransform

#: warps of the append kernel (one page-head of demotion per program) and rows of R_K per step of the in-kernel
#: key rotation: stated once, in the launch plan (kernels/aot/launch_plan.py).
APPEND_WARPS = _plan.DECODE_APPEND.num_warps
ROT_BLOCK = _plan.ROT_BLOCK


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
    RB: tl.constexpr, NONFINITE: tl.constexpr, K_PACKING: tl.constexpr, V_PACKING: tl.constexpr,
    K_BITS: tl.constexpr, GQ: tl.constexpr, ROTATE_Q: tl.constexpr,
):
    """One token of one (sequence, KV head). Grid ``(B, H_kv)``.

    Parameters (in order): k_ptr, v_ptr ``[B, H_kv, D]`` new rows (fp32/bf16/fp16; keys post-RoPE in the
    model basis if TRANSFORM, else already stored-basis; values with the rotation applied); q_ptr ``[B, H_kv * GQ,
    D]`` the step's queries in the model basis and q_rot_ptr fp32 ``[B, H_kv * GQ, D]`` their stored-basis
    rotation (read / written iff ROTATE_Q, whatever the status: attention runs for every row); rot_ptr fp32
    ``[H_kv, D, D]`` R_K, kscale_ptr/kmean_ptr/vmean_ptr fp32 ``[H_kv, D]`` (read iff TRANSFORM); sink_k/v bf16
    ``[B, H_kv, S0, D]``; recent_k/v bf16 ``[B, H_kv, C, D]`` rings; k/v codes and params: the pools;
    k_rank_ptr, v_rank_ptr int32 ``[H_kv]`` removals per group; k_levels_ptr, v_levels_ptr fp32 ``[H_kv, 4]``;
    block_table_ptr int32 ``[B, max_pages]``; sink_len/num_pages/recent_len int32 ``[B]`` committed lengths;
    status_ptr int32 ``[B]`` step status (read; NONFINITE or-ed in); max_pages int32;
    constexpr H_KV, P, D, G (value/token group size), S0, C (ring slots W + 2P), RCAP (W + P), K_CHANNEL,
    TRANSFORM, RB (rows of R per step), NONFINITE (the status bit), K_PACKING / V_PACKING (``layout.packing_code``
    of each pool), K_BITS (``layout.key.bits``: 2, or 4 with uniform levels; values are 2-bit), GQ (query heads
    per KV head), ROTATE_Q.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, D)
    row = (b * H_KV + h).to(tl.int64) * D
    if ROTATE_Q:
        _rotate_queries(q_ptr, q_rot_ptr, rot_ptr, kscale_ptr, b, h, H_KV, GQ, D)
    if TRANSFORM:
        acc = tl.zeros([D], tl.float32)
        for r0 in tl.static_range(0, D, RB):
            rr = r0 + tl.arange(0, RB)
            kb = tl.load(k_ptr + row + rr).to(tl.float32)
            rot = tl.load(rot_ptr + h * (D * D) + rr[:, None] * D + i[None, :])
            acc += tl.sum(kb[:, None] * rot, axis=0)
        k = acc * tl.load(kscale_ptr + h * D + i) - tl.load(kmean_ptr + h * D + i)
        v = tl.load(v_ptr + row + i).to(tl.float32) - tl.load(vmean_ptr + h * D + i)
    else:
        k = tl.load(k_ptr + row + i).to(tl.float32)
        v = tl.load(v_ptr + row + i).to(tl.float32)
    # finite before rounding (rounding NaN bits is meaningless) and after (a huge finite value rounds to inf);
    # every program also checks the other heads' inputs, so a token with a NaN in any head writes no head
    k16 = _round_bf16(k)
    v16 = _round_bf16(v)
    fin = _finite(k) & _finite(v) & _finite(k16) & _finite(v16)
    HP: tl.constexpr = triton.next_power_of_2(H_KV)
    hh = tl.arange(0, HP)
    rows = (b * H_KV + hh).to(tl.int64)[:, None] * D + i[None, :]  # every KV head's row of this token
    heads = (hh < H_KV)[:, None]
    others = (_finite(tl.load(k_ptr + rows, mask=heads, other=0.0).to(tl.float32))
              & _finite(tl.load(v_ptr + rows, mask=heads, other=0.0).to(tl.float32)))
    finite = (tl.sum(fin.to(tl.int32), axis=0) == D) & (tl.sum(tl.sum(others.to(tl.int32), axis=1), axis=0) == HP * D)
    if not finite:
        tl.atomic_or(status_ptr + b, NONFINITE)
    ok = (tl.load(status_ptr + b) == 0) & finite
    if ok:
        sl = tl.load(sink_len_ptr + b)
        npg = tl.load(num_pages_ptr + b)
        rl = tl.load(recent_len_ptr + b)
        if sl < S0:
            dst = (b * H_KV + h).to(tl.int64) * (S0 * D) + sl * D + i
            tl.store(sink_k_ptr + dst, k16.to(tl.bfloat16))
            tl.store(sink_v_ptr + dst, v16.to(tl.bfloat16))
        else:
            ring = (b * H_KV + h).to(tl.int64) * (C * D)
            if rl == RCAP:  # demote page npg: its rows are ring slots (npg * P) mod C .. + P (C % P == 0)
                page = tl.load(block_table_ptr + b.to(tl.int64) * max_pages + npg).to(tl.int64)
                first = ring + ((npg * P) % C) * D
                _quantize_page(recent_k_ptr + first, D, k_codes_ptr, k_params_ptr, page * H_KV + h,
                               tl.load(k_rank_ptr + h), tl.load(k_levels_ptr + h * 4),
                               tl.load(k_levels_ptr + h * 4 + 1), tl.load(k_levels_ptr + h * 4 + 2),
                               tl.load(k_levels_ptr + h * 4 + 3), P, D, G, K_CHANNEL, K_PACKING, K_BITS)
                _quantize_page(recent_v_ptr + first, D, v_codes_ptr, v_params_ptr, page * H_KV + h,
                               tl.load(v_rank_ptr + h), tl.load(v_levels_ptr + h * 4),
                               tl.load(v_levels_ptr + h * 4 + 1), tl.load(v_levels_ptr + h * 4 + 2),
                               tl.load(v_levels_ptr + h * 4 + 3), P, D, G, False, V_PACKING, 2)
            dst = ring + ((npg * P + rl) % C) * D + i
            tl.store(recent_k_ptr + dst, k16.to(tl.bfloat16))
            tl.store(recent_v_ptr + dst, v16.to(tl.bfloat16))


@triton.jit
def _rotate_queries(q_ptr, q_rot_ptr, rot_ptr, kscale_ptr, b, h, H_KV: tl.constexpr, GQ: tl.constexpr,
                    D: tl.constexpr):
    """``q_rot[b, h GQ + g] = (q[b, h GQ + g] @ R_K[h]) / d_K[h]`` for the ``GQ`` query heads of KV head ``h``
    (fp32 FMA products over ``QB``-row chunks of ``R_K[h]``, a ``[GQ_PAD, QB, D]`` product of 4K elements)."""
    GQ_PAD: tl.constexpr = 1 if GQ <= 1 else (2 if GQ <= 2 else (4 if GQ <= 4 else (8 if GQ <= 8 else (
        16 if GQ <= 16 else (32 if GQ <= 32 else 64)))))
    QB: tl.constexpr = 4096 // (GQ_PAD * D) if 4096 // (GQ_PAD * D) >= 1 else 1
    g = tl.arange(0, GQ_PAD)
    i = tl.arange(0, D)
    qrow = (b * (H_KV * GQ) + h * GQ + g).to(tl.int64) * D  # [GQ_PAD]
    gmask = (g < GQ)[:, None]
    acc = tl.zeros([GQ_PAD, D], tl.float32)
    for r0 in tl.static_range(0, D, QB):
        rr = r0 + tl.arange(0, QB)
        qb = tl.load(q_ptr + qrow[:, None] + rr[None, :], mask=gmask, other=0.0).to(tl.float32)  # [GQ_PAD, QB]
        rot = tl.load(rot_ptr + h * (D * D) + rr[:, None] * D + i[None, :])  # [QB, D]
        acc += tl.sum(qb[:, :, None] * rot[None, :, :], axis=1)
    acc = acc / tl.load(kscale_ptr + h * D + i)[None, :]
    tl.store(q_rot_ptr + qrow[:, None] + i[None, :], acc, mask=gmask)


# ---- wrapper ------------------------------------------------------------------------------------------------


def decode_append(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, *, fused_transform: bool = False,
    group_removals: tuple[torch.Tensor, torch.Tensor] | None = None, q: torch.Tensor | None = None,
    wrap=lambda f: f,
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
        wrap: wraps the kernel before launch (``torch.library.wrap_triton`` in :mod:`.triton_ops`).
    Returns:
        With ``q``: ``[B, H, D]`` float32 ``transform.transform_queries(q)`` (fp32 FMAs in the kernel: equal to
        :func:`rotate_queries` up to the summation order), what the decode attention kernels take as their
        stored-basis query; else None.
    """
    check_decode_append_inputs(state, k, v, status, layout, transform, q)
    h, d, p = layout.num_kv_heads, layout.head_dim, layout.page_size
    tr = transform
    k_rem, v_rem = group_removals if group_removals is not None else removals(layout, tr)
    q_rot = None if q is None else torch.empty(q.shape, dtype=torch.float32, device=q.device)
    wrap(_decode_append_kernel)[(k.shape[0], h)](
        k, v, k if q is None else q, k if q_rot is None else q_rot, tr.k_rotation, tr.k_scale, tr.k_mean, tr.v_mean,
        state.sink_k, state.sink_v, state.recent_k, state.recent_v,
        state.k_codes, state.k_params, state.v_codes, state.v_params,
        k_rem, v_rem, tr.k_levels, tr.v_levels,
        state.block_table, state.sink_len, state.num_pages, state.recent_len, status,
        state.block_table.shape[1],
        H_KV=h, P=p, D=d, G=layout.value.group_size, S0=layout.sink, C=layout.recent_slots,
        RCAP=layout.recent_capacity, K_CHANNEL=layout.key.granularity == "channel", TRANSFORM=fused_transform,
        RB=min(ROT_BLOCK, d), NONFINITE=STATUS_NONFINITE, K_PACKING=packing_code(layout.key, "key"),
        V_PACKING=packing_code(layout.value, "value"), K_BITS=layout.key.bits,
        GQ=1 if q is None else q.shape[1] // h, ROTATE_Q=q is not None, num_warps=APPEND_WARPS,
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


def check_decode_append_inputs(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, q: torch.Tensor | None = None,
) -> None:
    """Raise on anything :func:`decode_append` cannot launch on (shapes, dtypes, devices only)."""
    h, d, p = layout.num_kv_heads, layout.head_dim, layout.page_size
    check_format(layout.key, p, "decode_append key")
    check_format(layout.value, p, "decode_append value")
    if layout.value.bits != 2:
        raise NotImplementedError(f"decode_append: values are 2-bit (only keys may be wider), got {layout.value.bits}")
    if layout.window % p:
        raise NotImplementedError(f"decode_append: the window ({layout.window}) must be a multiple of P={p}")
    if k.dim() != 3:
        raise ValueError(f"k: expected [B, H_kv, D], got {list(k.shape)}")
    bsz = k.shape[0]
    dev = k.device
    for name, t in (("k", k), ("v", v)):
        _check(name, t, (bsz, h, d), (torch.float32, torch.bfloat16, torch.float16), dev)
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    _check("status", status, (bsz,), torch.int32, dev)
    if q is not None:
        if q.dim() != 3 or q.shape[0] != bsz or q.shape[1] % h or q.shape[2] != d or not 0 < q.shape[1] // h <= 64:
            raise ValueError(f"q: expected [{bsz}, H_kv * GQ (GQ <= 64), {d}] with H_kv={h}, got {list(q.shape)}")
        _check("q", q, tuple(q.shape), (torch.float32, torch.bfloat16, torch.float16), dev)
        if not q.is_contiguous():
            raise ValueError("q: expected a contiguous tensor")
    check_paged_state(state, layout, bsz, dev)
    tr = transform
    for name, t, shape in (("k_clip", tr.k_clip, (h,)), ("v_clip", tr.v_clip, (h,)),
                           ("k_levels", tr.k_levels, (h, 4)), ("v_levels", tr.v_levels, (h, 4)),
                           ("k_rotation", tr.k_rotation, (h, d, d)), ("k_scale", tr.k_scale, (h, d)),
                           ("k_mean", tr.k_mean, (h, d)), ("v_mean", tr.v_mean, (h, d))):
        _check(f"transform.{name}", t, shape, torch.float32, dev)
        if not t.is_contiguous():
            raise ValueError(f"transform.{name}: expected a contiguous tensor")
    if layout.key.granularity == "token" and layout.key.group_size != layout.value.group_size:
        raise NotImplementedError("decode_append: key and value token group sizes must match")


__all__ = ["APPEND_WARPS", "check_decode_append_inputs", "decode_append", "removals", "rotate_queries"]
