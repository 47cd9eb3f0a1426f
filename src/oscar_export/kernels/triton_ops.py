"""The Triton kernels as PyTorch custom ops, so ``torch.compile(fullgraph=True)`` sees them without graph breaks.

=====================================  ======================================================================
``oscar::decode_attention``            ``[B, H, D]`` output of queries in the stored key basis; reads the
                                       cache (``mutates_args=()``): the portable kernel over linear pages or
                                       the hopper (Gluon) kernel over mma16 pages, by the layout's packing
                                       (``decode.select_backend``); no query rotation in any split program
``oscar::decode_append``               writes one token per sequence (+ demotion when due) into the cache;
                                       asked (``rotate_q``), the same launch returns the step's queries in the
                                       stored key basis, a fresh fp32 tensor (the rotation once a step,
                                       docs/design.md §3.6)
=====================================  ======================================================================

Both are ``torch.library.custom_op`` s with a fake implementation for the output's shape: opaque to Dynamo and
Inductor, which therefore neither trace the Python around a launch nor analyse the kernels (Inductor's analysis
of a ``triton_op``'s kernel compiles it to TTIR at every call site, twice: with two launches a layer that is
most of a compile), and captured as they are in the step's CUDA graph.

Every check is made once, by :func:`plan_decode` / :func:`plan_append`, when a cache is made (the HF cache keeps
the plans); a traced step calls :func:`run_decode` / :func:`run_append`, which read no pointer, no device value
and no shape-dependent Python value. :func:`decode_attention` and :func:`decode_append` are the eager entry points
(plan + run) with the plain wrappers' signatures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import decode_step
from .checks import check_decode_append_inputs
from .decode import hopper, portable
from .decode_step import removals
from .layout import KVCacheLayout, PagedKV, packing_code
from .transform import LayerTransform

_WINDOWS = ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params")
_BOOK = ("block_table", "sink_len", "num_pages", "recent_len")


@torch.library.custom_op("oscar::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, recent_k: torch.Tensor, recent_v: torch.Tensor,
    k_codes: torch.Tensor, k_params: torch.Tensor, v_codes: torch.Tensor, v_params: torch.Tensor,
    k_levels: torch.Tensor, v_levels: torch.Tensor, block_table: torch.Tensor, sink_len: torch.Tensor,
    num_pages: torch.Tensor, recent_len: torch.Tensor, hopper_kernel: bool, num_kv_heads: int, page_size: int,
    sink: int, recent_slots: int, scale: float, k_channel: bool, codebook: bool, fast_unpack: bool,
    pages_per_split: int, out_dtype: torch.dtype, group_size: int, key_bits: int,
) -> torch.Tensor:
    if hopper_kernel:
        return hopper.launch(
            q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
            block_table, sink_len, num_pages, recent_len, num_kv_heads, page_size, sink, recent_slots, scale,
            k_channel, pages_per_split, out_dtype,
        )
    return portable.launch_decode(
        q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
        block_table, sink_len, num_pages, recent_len, num_kv_heads, page_size, sink, recent_slots, scale,
        k_channel, codebook, fast_unpack, pages_per_split, out_dtype, group_size=group_size, key_bits=key_bits,
    )


@_decode_attention_op.register_fake
def _(q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
      block_table, sink_len, num_pages, recent_len, hopper_kernel, num_kv_heads, page_size, sink, recent_slots, scale,
      k_channel, codebook, fast_unpack, pages_per_split, out_dtype, group_size, key_bits):
    return q.new_empty(q.shape, dtype=out_dtype)


@dataclass(frozen=True)
class DecodePlan:
    """One layer's decode launch, checked (:func:`plan_decode`): everything but the tensors and the scale."""

    hopper_kernel: bool
    num_kv_heads: int
    page_size: int
    sink: int
    recent_slots: int
    k_channel: bool
    codebook: bool
    fast_unpack: bool
    pages_per_split: int
    out_dtype: torch.dtype
    group_size: int
    key_bits: int


def plan_decode(
    q: torch.Tensor, state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor,
    scale: float, *, out_dtype: torch.dtype = torch.float32, pages_per_split: int | None = None,
) -> DecodePlan:
    """Every check of a decode launch (``q`` may be any tensor of the step's query shape, dtype and device: the
    queries in the stored key basis). The kernel follows the page packing: mma16 -> hopper, linear -> portable
    (``decode.select_backend`` chose)."""
    if layout.packing == "mma16":
        pps = hopper.checked_pages_per_split(q, state, layout, k_levels, v_levels, scale, out_dtype, pages_per_split)
        if q.device.type == "cuda":  # allocated now, outside any CUDA-graph pool (a compiled step's warm-up runs
            hopper.merge_counters(q.device, min(q.shape[0] * layout.num_kv_heads, hopper.MERGE_COUNTERS))
    else:
        pps = portable.checked_pages_per_split(q, state, layout, k_levels, v_levels, scale, out_dtype,
                                               pages_per_split)
    codebook = bool(layout.key.codebook or layout.value.codebook)
    return DecodePlan(
        layout.packing == "mma16", layout.num_kv_heads, layout.page_size, layout.sink, layout.recent_slots,
        layout.key.granularity == "channel", codebook, q.device.type == "cuda" and not codebook, pps, out_dtype,
        layout.value.group_size, layout.key.bits,
    )


def run_decode(plan: DecodePlan, q: torch.Tensor, state: PagedKV, k_levels: torch.Tensor, v_levels: torch.Tensor,
               scale: float) -> torch.Tensor:
    """``oscar::decode_attention`` on a checked plan (no checks: what a traced step calls)."""
    p = plan
    return torch.ops.oscar.decode_attention(
        q, *(getattr(state, f) for f in _WINDOWS), k_levels, v_levels, *(getattr(state, f) for f in _BOOK),
        p.hopper_kernel, p.num_kv_heads, p.page_size, p.sink, p.recent_slots, float(scale), p.k_channel, p.codebook,
        p.fast_unpack, p.pages_per_split, p.out_dtype, p.group_size, p.key_bits,
    )


def decode_attention(
    q: torch.Tensor,
    state: PagedKV,
    layout: KVCacheLayout,
    k_levels: torch.Tensor,
    v_levels: torch.Tensor,
    scale: float,
    *,
    out_dtype: torch.dtype = torch.float32,
    pages_per_split: int | None = None,
) -> torch.Tensor:
    """``reference.decode_attention`` through ``oscar::decode_attention`` (arguments as the portable wrapper's;
    ``q`` in the stored key basis): :func:`plan_decode`, then :func:`run_decode`."""
    plan = plan_decode(q, state, layout, k_levels, v_levels, scale, out_dtype=out_dtype,
                       pages_per_split=pages_per_split)
    return run_decode(plan, q, state, k_levels, v_levels, scale)


@torch.library.custom_op(
    "oscar::decode_append",
    mutates_args=("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params",
                  "status"),
)
def _decode_append_op(
    k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, k_rotation: torch.Tensor, k_scale: torch.Tensor,
    k_mean: torch.Tensor, v_mean: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, recent_k: torch.Tensor,
    recent_v: torch.Tensor, k_codes: torch.Tensor, k_params: torch.Tensor, v_codes: torch.Tensor,
    v_params: torch.Tensor, k_removals: torch.Tensor, v_removals: torch.Tensor, k_levels: torch.Tensor,
    v_levels: torch.Tensor, block_table: torch.Tensor, sink_len: torch.Tensor, num_pages: torch.Tensor,
    recent_len: torch.Tensor, status: torch.Tensor, page_size: int, sink: int, recent_slots: int,
    recent_capacity: int, group_size: int, k_channel: bool, fused_transform: bool, k_packing: int, v_packing: int,
    key_bits: int, rotate_q: bool,
) -> torch.Tensor:
    return decode_step.launch(
        k, v, q, k_rotation, k_scale, k_mean, v_mean, sink_k, sink_v, recent_k, recent_v, k_codes, k_params,
        v_codes, v_params, k_removals, v_removals, k_levels, v_levels, block_table, sink_len, num_pages, recent_len,
        status, page_size, sink, recent_slots, recent_capacity, group_size, k_channel, fused_transform, k_packing,
        v_packing, key_bits, rotate_q,
    )


@_decode_append_op.register_fake
def _(k, v, q, *args):
    rotate_q = args[-1]
    return q.new_empty(q.shape, dtype=torch.float32) if rotate_q else q.new_empty(0)


@dataclass(frozen=True)
class AppendPlan:
    """One layer's decode-step write, checked (:func:`plan_append`): its removals and constants; ``rotate_q``: the
    launch also returns the step's queries in the stored key basis."""

    k_removals: torch.Tensor
    v_removals: torch.Tensor
    page_size: int
    sink: int
    recent_slots: int
    recent_capacity: int
    group_size: int
    k_channel: bool
    fused_transform: bool
    k_packing: int
    v_packing: int
    key_bits: int
    rotate_q: bool


def plan_append(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, *, fused_transform: bool = False,
    group_removals: tuple[torch.Tensor, torch.Tensor] | None = None, q: torch.Tensor | None = None,
) -> AppendPlan:
    """Every check of a decode-step write (``k``, ``v`` and ``q`` any tensors of the step's shape, dtype and
    device); with ``q`` the launch also rotates the step's queries (:func:`.decode_step.decode_append`)."""
    check_decode_append_inputs(state, k, v, status, layout, transform, q)
    k_rem, v_rem = group_removals if group_removals is not None else removals(layout, transform)
    return AppendPlan(k_rem, v_rem, layout.page_size, layout.sink, layout.recent_slots, layout.recent_capacity,
                      layout.value.group_size, layout.key.granularity == "channel", fused_transform,
                      packing_code(layout.key, "key"), packing_code(layout.value, "value"), layout.key.bits,
                      q is not None)


def run_append(plan: AppendPlan, state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor,
               transform: LayerTransform, q: torch.Tensor | None = None) -> torch.Tensor | None:
    """``oscar::decode_append`` on a checked plan (no checks: what a traced step calls). Returns the step's
    queries in the stored key basis (fp32, a fresh tensor) if the plan rotates them (``q`` then required), else
    None."""
    p, tr = plan, transform
    q_s = torch.ops.oscar.decode_append(
        k, v, q if p.rotate_q else k, tr.k_rotation, tr.k_scale, tr.k_mean, tr.v_mean,
        *(getattr(state, f) for f in _WINDOWS), p.k_removals, p.v_removals, tr.k_levels, tr.v_levels,
        *(getattr(state, f) for f in _BOOK), status, p.page_size, p.sink, p.recent_slots, p.recent_capacity,
        p.group_size, p.k_channel, p.fused_transform, p.k_packing, p.v_packing, p.key_bits, p.rotate_q,
    )
    return q_s if p.rotate_q else None


def decode_append(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, *, fused_transform: bool = False,
    group_removals: tuple[torch.Tensor, torch.Tensor] | None = None, q: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """:func:`.decode_step.decode_append` through ``oscar::decode_append``: :func:`plan_append`, then
    :func:`run_append` (with ``q``: returns the step's queries in the stored key basis, fp32)."""
    plan = plan_append(state, k, v, status, layout, transform, fused_transform=fused_transform,
                       group_removals=group_removals, q=q)
    return run_append(plan, state, k, v, status, transform, q)


__all__ = ["AppendPlan", "DecodePlan", "decode_append", "decode_attention", "plan_append", "plan_decode",
           "run_append", "run_decode"]
