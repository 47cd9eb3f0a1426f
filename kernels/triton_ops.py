"""The Triton kernels as PyTorch custom ops, so ``torch.compile`` sees them without graph breaks.

``torch.library.triton_op`` registers each op with a schema of tensors and plain scalars; inside, the
kernels launch through ``torch.library.wrap_triton``, which lets Inductor trace and schedule them (and
gives fake-tensor shape propagation for free). The Python entry points take the same arguments as the
plain wrappers (:func:`.decode_attention.decode_attention`, :func:`.decode_step.decode_step_update`), run
the same input checks and then call the op:

=====================================  ======================================================================
``oscar::decode_attention``            ``[B, H, D]`` output; reads the cache (``mutates_args=()``)
``oscar::decode_step_update``          writes one token per sequence (+ demotion when due) into the cache
=====================================  ======================================================================
"""

from __future__ import annotations

import torch

from .decode_attention import check_decode_inputs, launch_decode
from .layout import KVCacheLayout, PagedKV
from .decode_step import _append_kernel, _demote_due_kernel, check_decode_step_inputs
from .quant_pack import removal_counts
from .transform import LayerTransform

_STATE = ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params",
          "block_table", "sink_len", "num_pages", "recent_len")


@torch.library.triton_op("oscar::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, rot: torch.Tensor, dsc: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor,
    recent_k: torch.Tensor, recent_v: torch.Tensor, k_codes: torch.Tensor, k_params: torch.Tensor,
    v_codes: torch.Tensor, v_params: torch.Tensor, k_levels: torch.Tensor, v_levels: torch.Tensor,
    block_table: torch.Tensor, sink_len: torch.Tensor, num_pages: torch.Tensor, recent_len: torch.Tensor,
    num_kv_heads: int, page_size: int, sink: int, recent_capacity: int, scale: float, k_channel: bool,
    codebook: bool, rotate_q: bool, fast_unpack: bool, pages_per_split: int, out_dtype: torch.dtype,
) -> torch.Tensor:
    return launch_decode(
        q, rot, dsc, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
        block_table, sink_len, num_pages, recent_len, num_kv_heads, page_size, sink, recent_capacity, scale,
        k_channel, codebook, rotate_q, fast_unpack, pages_per_split, out_dtype, wrap=torch.library.wrap_triton,
    )


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
) -> torch.Tensor:
    """:func:`.decode_attention.decode_attention` through the ``oscar::decode_attention`` custom op."""
    rot, dsc, pps = check_decode_inputs(q, state, layout, k_levels, v_levels, scale, q_rotation, out_dtype,
                                        pages_per_split)
    codebook = layout.key.codebook or layout.value.codebook
    return torch.ops.oscar.decode_attention(
        q, rot, dsc, *(getattr(state, f) for f in _STATE[:8]), k_levels, v_levels,
        *(getattr(state, f) for f in _STATE[8:]), layout.num_kv_heads, layout.page_size,
        layout.sink, layout.recent_capacity, float(scale), layout.key.granularity == "channel", codebook,
        q_rotation is not None, q.device.type == "cuda" and not codebook, pps, out_dtype,
    )


@torch.library.triton_op(
    "oscar::decode_step_update",
    mutates_args=("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params",
                  "sink_len", "num_pages", "recent_len"),
)
def _decode_step_update_op(
    k: torch.Tensor, v: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, recent_k: torch.Tensor,
    recent_v: torch.Tensor, k_codes: torch.Tensor, k_params: torch.Tensor, v_codes: torch.Tensor,
    v_params: torch.Tensor, block_table: torch.Tensor, sink_len: torch.Tensor, num_pages: torch.Tensor,
    recent_len: torch.Tensor, k_removals: torch.Tensor, v_removals: torch.Tensor, k_levels: torch.Tensor,
    v_levels: torch.Tensor, page_size: int, sink: int, recent_capacity: int, group_size: int, k_channel: bool,
) -> None:
    bsz, h, d = k.shape
    torch.library.wrap_triton(_demote_due_kernel)[(bsz, h)](
        recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_removals, v_removals, k_levels, v_levels,
        block_table, num_pages, recent_len, block_table.shape[1],
        H_KV=h, P=page_size, D=d, G=group_size, RC=recent_capacity, K_CHANNEL=k_channel, num_warps=4,
    )
    torch.library.wrap_triton(_append_kernel)[(bsz,)](
        k, v, sink_k, sink_v, recent_k, recent_v, sink_len, num_pages, recent_len,
        H_KV=h, H_PAD=1 << max(0, (h - 1).bit_length()), D=d, P=page_size, S0=sink, RC=recent_capacity,
        num_warps=4,
    )


def decode_step_update(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout, transform: LayerTransform
) -> None:
    """:func:`.decode_step.decode_step_update` through the ``oscar::decode_step_update`` custom op."""
    check_decode_step_inputs(state, k, v, layout, transform)
    tr = transform
    k_group = layout.page_size if layout.key.granularity == "channel" else layout.key.group_size
    torch.ops.oscar.decode_step_update(
        k, v, *(getattr(state, f) for f in _STATE), removal_counts(tr.k_clip, k_group),
        removal_counts(tr.v_clip, layout.value.group_size), tr.k_levels.contiguous(), tr.v_levels.contiguous(),
        layout.page_size, layout.sink, layout.recent_capacity, layout.value.group_size,
        layout.key.granularity == "channel",
    )


__all__ = ["decode_attention", "decode_step_update"]
