"""The Triton kernels as PyTorch custom ops, so ``torch.compile`` sees them without graph breaks.

``torch.library.triton_op`` registers each op with a schema of tensors and plain scalars; inside, the
kernels launch through ``torch.library.wrap_triton``, which lets Inductor trace and schedule them (and
gives fake-tensor shape propagation for free). The Python entry points take the same arguments as the
plain wrappers (:func:`.decode_attention.decode_attention`, :func:`.decode_step.decode_append`), run
the same input checks and then call the op:

=====================================  ======================================================================
``oscar::decode_attention``            ``[B, H, D]`` output; reads the cache (``mutates_args=()``): v1, linear pages
``oscar::decode_attention_v2``         the same over mma16 pages (v2 "fields"/"tile" or v3 "gluon"); a
                                       ``torch.library.custom_op``, opaque to Inductor (which cannot trace a
                                       Gluon kernel), with a fake implementation for the output's shape
``oscar::decode_append``               writes one token per sequence (+ demotion when due) into the cache
=====================================  ======================================================================

:func:`decode_attention` picks the op by the layout's page packing.
"""

from __future__ import annotations

import torch

from . import decode_attention_v2 as _v2
from .decode_attention import check_decode_inputs, launch_decode
from .layout import KVCacheLayout, PagedKV, packing_code
from .decode_step import APPEND_WARPS, ROT_BLOCK, _decode_append_kernel, check_decode_append_inputs, removals
from .pages import STATUS_NONFINITE
from .transform import LayerTransform

_STATE = ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params",
          "block_table", "sink_len", "num_pages", "recent_len")


@torch.library.triton_op("oscar::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, rot: torch.Tensor, dsc: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor,
    recent_k: torch.Tensor, recent_v: torch.Tensor, k_codes: torch.Tensor, k_params: torch.Tensor,
    v_codes: torch.Tensor, v_params: torch.Tensor, k_levels: torch.Tensor, v_levels: torch.Tensor,
    block_table: torch.Tensor, sink_len: torch.Tensor, num_pages: torch.Tensor, recent_len: torch.Tensor,
    num_kv_heads: int, page_size: int, sink: int, recent_slots: int, scale: float, k_channel: bool,
    codebook: bool, rotate_q: bool, fast_unpack: bool, pages_per_split: int, out_dtype: torch.dtype,
    group_size: int, key_bits: int,
) -> torch.Tensor:
    return launch_decode(
        q, rot, dsc, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
        block_table, sink_len, num_pages, recent_len, num_kv_heads, page_size, sink, recent_slots, scale,
        k_channel, codebook, rotate_q, fast_unpack, pages_per_split, out_dtype, wrap=torch.library.wrap_triton,
        group_size=group_size, key_bits=key_bits,
    )


@torch.library.custom_op("oscar::decode_attention_v2", mutates_args=())
def _decode_attention_v2_op(
    q: torch.Tensor, out_dtype: torch.dtype, rot: torch.Tensor, dsc: torch.Tensor, sink_k: torch.Tensor,
    sink_v: torch.Tensor, recent_k: torch.Tensor, recent_v: torch.Tensor, k_codes: torch.Tensor, k_params: torch.Tensor,
    v_codes: torch.Tensor, v_params: torch.Tensor, k_levels: torch.Tensor, v_levels: torch.Tensor,
    block_table: torch.Tensor, sink_len: torch.Tensor, num_pages: torch.Tensor, recent_len: torch.Tensor,
    num_kv_heads: int, page_size: int, sink: int, recent_slots: int, scale: float, k_channel: bool,
    codebook: bool, rotate_q: bool, fast_unpack: bool, pages_per_split: int, variant: str, num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    return _v2.launch_decode_v2(
        q, rot, dsc, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
        block_table, sink_len, num_pages, recent_len, num_kv_heads, page_size, sink, recent_slots, scale,
        k_channel, codebook, rotate_q, pages_per_split, out_dtype, num_warps, num_stages, variant=variant,
        fast_unpack=fast_unpack,
    )


@_decode_attention_v2_op.register_fake
def _(q, out_dtype, *_):
    return q.new_empty(q.shape, dtype=out_dtype)


def decode_attention(
    q: torch.Tensor,
    state: PagedKV,
    layout: KVCacheLayout,
    k_levels: torch.Tensor,
    v_levels: torch.Tensor,
    scale: float,
    *,
    q_rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype = torch.float32,
    pages_per_split: int | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """Decode attention through the custom ops: :func:`.decode_attention.decode_attention` (``oscar::decode_attention``)
    for linear pages, :func:`.decode_attention_v2.decode_attention` (``oscar::decode_attention_v2``) for mma16 pages.

    ``variant``: the mma16 kernel (``decode_attention_v2.KERNELS``: ``"fields"``, the default, ``"tile"`` or
    ``"gluon"``); linear pages have one kernel and take None."""
    if layout.packing != "linear":
        return _decode_attention_mma16(q, state, layout, k_levels, v_levels, scale, q_rotation, out_dtype,
                                       pages_per_split, variant or "fields")
    if variant is not None:
        raise ValueError(f"variant {variant!r}: linear pages have one decode kernel (v1); variants are for mma16 pages")
    rot, dsc, pps = check_decode_inputs(q, state, layout, k_levels, v_levels, scale, q_rotation, out_dtype,
                                        pages_per_split)
    codebook = layout.key.codebook or layout.value.codebook
    return torch.ops.oscar.decode_attention(
        q, rot, dsc, *(getattr(state, f) for f in _STATE[:8]), k_levels, v_levels,
        *(getattr(state, f) for f in _STATE[8:]), layout.num_kv_heads, layout.page_size,
        layout.sink, layout.recent_slots, float(scale), layout.key.granularity == "channel", codebook,
        q_rotation is not None, q.device.type == "cuda" and not codebook, pps, out_dtype, layout.value.group_size,
        layout.key.bits,
    )


def _decode_attention_mma16(q, state, layout, k_levels, v_levels, scale, q_rotation, out_dtype, pages_per_split,
                            variant: str) -> torch.Tensor:
    rot, dsc, pps, codebook = _v2.check_decode_v2_inputs(q, state, layout, k_levels, v_levels, scale, q_rotation,
                                                          out_dtype, pages_per_split, variant, None)
    num_warps, num_stages = _v2.launch_options(variant, None, None)
    return torch.ops.oscar.decode_attention_v2(
        q, out_dtype, rot, dsc, *(getattr(state, f) for f in _STATE[:8]), k_levels, v_levels,
        *(getattr(state, f) for f in _STATE[8:]), layout.num_kv_heads, layout.page_size,
        layout.sink, layout.recent_slots, float(scale), layout.key.granularity == "channel", codebook,
        q_rotation is not None, q.device.type == "cuda" and not codebook, pps, variant, num_warps, num_stages,
    )


@torch.library.triton_op(
    "oscar::decode_append",
    mutates_args=("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params",
                  "status"),
)
def _decode_append_op(
    k: torch.Tensor, v: torch.Tensor, k_rotation: torch.Tensor, k_scale: torch.Tensor, k_mean: torch.Tensor,
    v_mean: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, recent_k: torch.Tensor,
    recent_v: torch.Tensor, k_codes: torch.Tensor, k_params: torch.Tensor, v_codes: torch.Tensor,
    v_params: torch.Tensor, k_removals: torch.Tensor, v_removals: torch.Tensor, k_levels: torch.Tensor,
    v_levels: torch.Tensor, block_table: torch.Tensor, sink_len: torch.Tensor, num_pages: torch.Tensor,
    recent_len: torch.Tensor, status: torch.Tensor, page_size: int, sink: int, recent_slots: int,
    recent_capacity: int, group_size: int, k_channel: bool, fused_transform: bool, k_packing: int, v_packing: int,
    key_bits: int,
) -> None:
    bsz, h, d = k.shape
    torch.library.wrap_triton(_decode_append_kernel)[(bsz, h)](
        k, v, k, k, k_rotation,  # q_ptr, q_rot_ptr: unread (ROTATE_Q off) k_scale, k_mean, v_mean, sink_k, sink_v, recent_k, recent_v,
        k_codes, k_params, v_codes, v_params, k_removals, v_removals, k_levels, v_levels,
        block_table, sink_len, num_pages, recent_len, status, block_table.shape[1],
        H_KV=h, P=page_size, D=d, G=group_size, S0=sink, C=recent_slots, RCAP=recent_capacity,
        K_CHANNEL=k_channel, TRANSFORM=fused_transform, RB=min(ROT_BLOCK, d), NONFINITE=STATUS_NONFINITE,
        K_PACKING=k_packing, V_PACKING=v_packing, K_BITS=key_bits, GQ=1, ROTATE_Q=False, num_warps=APPEND_WARPS,
    )


def decode_append(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, *, fused_transform: bool = False,
    group_removals: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """:func:`.decode_step.decode_append` through the ``oscar::decode_append`` custom op."""
    check_decode_append_inputs(state, k, v, status, layout, transform)
    tr = transform
    k_rem, v_rem = group_removals if group_removals is not None else removals(layout, tr)
    torch.ops.oscar.decode_append(
        k, v, tr.k_rotation, tr.k_scale, tr.k_mean, tr.v_mean, *(getattr(state, f) for f in _STATE[:8]),
        k_rem, v_rem, tr.k_levels, tr.v_levels, *(getattr(state, f) for f in _STATE[8:]), status,
        layout.page_size, layout.sink, layout.recent_slots, layout.recent_capacity, layout.value.group_size,
        layout.key.granularity == "channel", fused_transform, packing_code(layout.key, "key"),
        packing_code(layout.value, "value"), layout.key.bits,
    )


__all__ = ["decode_append", "decode_attention"]
