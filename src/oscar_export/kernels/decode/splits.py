"""A decode attention in splits: the partials of the ``(sequence, KV head, split)`` programs merged by log-sum-exp.

Both split kernels (the portable ``decode/portable.py:decode_split_kernel`` and the hopper
``decode/hopper_kernel.py`` ones) take the same parameters in the same order and write the same partials: the
normalised output of each split ``part_o [B, H, n_splits, D]`` and its log2-sum-exp ``part_lse [B, H, n_splits]``.
This module holds what follows them: ``merge_kernel``, grid ``(B * H,)``, which combines the splits of one query
head; :func:`launch_split_merge`, the host's launch of a split kernel and the merge over its partials (the grids and
int32 arguments from the launch plan, ``kernels/aot/launch_plan.py``); and :func:`sm_count`, the GPU size both
backends' split counts read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..aot import launch_plan as _plan
from ..cache_keys import hash_bottom_up


@triton.jit
def merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, n_splits, D: tl.constexpr, CH: tl.constexpr):
    """Combine the splits of one query head. Grid ``(B * H,)``.

    Parameters: part_o_ptr fp32 ``[B, H, n_splits, D]``, part_lse_ptr fp32 ``[B, H, n_splits]``, out_ptr
    ``[B, H, D]`` (fp32/bf16/fp16), n_splits int32; constexpr D, CH (splits per step). A head with nothing
    to attend writes zeros (as the reference does).
    """
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, CH)
    dd = tl.arange(0, D)
    mx = tl.full([CH], float("-inf"), tl.float32)
    for c0 in range(0, n_splits, CH):
        lse = tl.load(part_lse_ptr + row * n_splits + c0 + k, mask=c0 + k < n_splits, other=float("-inf"))
        mx = tl.maximum(mx, lse)
    mtot = tl.max(mx, axis=0)
    muse = tl.where(mtot == float("-inf"), 0.0, mtot)
    den = tl.zeros([CH], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for c0 in range(0, n_splits, CH):
        kmask = c0 + k < n_splits
        lse = tl.load(part_lse_ptr + row * n_splits + c0 + k, mask=kmask, other=float("-inf"))
        w = tl.exp2(lse - muse)
        o = tl.load(part_o_ptr + (row * n_splits + c0 + k)[:, None] * D + dd[None, :], mask=kmask[:, None], other=0.0)
        den += w
        acc += tl.sum(w[:, None] * o, axis=0)
    dtot = tl.sum(den, axis=0)
    res = tl.where(dtot > 0.0, acc / tl.where(dtot > 0.0, dtot, 1.0), 0.0)
    tl.store(out_ptr + row * D + dd, res.to(out_ptr.dtype.element_ty))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 132 (the H100 / H200's) for any other device."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132



def launch_split_merge(
    split_kernel, plan, q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels,
    v_levels, block_table, sink_len, num_pages, recent_len, pages_per_split: int, out_dtype: torch.dtype,
    constexprs: dict, num_warps: int, num_stages: int, wrap=lambda k: k, counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Allocate the partials, launch ``split_kernel`` (the portable or a Gluon one: the same parameters in the same
    order, then ``constexprs``) and :func:`merge_kernel` over them; returns ``[B, H, D]`` in ``out_dtype``.

    ``plan``: the split kernel's launch plan (``launch_plan.DECODE_SPLIT`` or a Gluon one), whose rules give its int32
    arguments (``n_page_splits = cdiv(max_pages, pages_per_split)``, ``n_splits = n_page_splits + n_bf16``, the BF16
    sink and recent chunks) and its grid ``(B * H_kv, n_splits)``; merge ``(B * H,)``. ``wrap`` wraps each kernel
    before launch. With ``counters`` (int32, zero, at least ``B * H_kv``) the split kernel merges in its last
    programs (``out`` and ``counters`` follow the partials in its parameters) and no merge is launched.
    """
    bsz, hq, d = q.shape
    scalars = plan.scalars({"max_pages": block_table.shape[1], "pages_per_split": pages_per_split}, constexprs)
    n_splits = scalars["n_splits"]
    part_o = torch.empty((bsz, hq, n_splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((bsz, hq, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((bsz, hq, d), dtype=out_dtype, device=q.device)
    fused = () if counters is None else (out, counters)
    wrap(split_kernel)[plan.grid_for({"B": bsz, **scalars}, constexprs)](
        q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
        block_table, sink_len, num_pages, recent_len, part_o, part_lse, *fused, *scalars.values(),
        **constexprs, num_warps=num_warps, num_stages=num_stages,
    )
    if counters is None:
        merge = _plan.DECODE_MERGE
        wrap(merge_kernel)[merge.grid_for({"rows": bsz * hq}, {})](
            part_o, part_lse, out, n_splits, **_plan.decode_merge_constexprs(d), num_warps=merge.num_warps)
    return out


hash_bottom_up(globals())  # one Triton cache key per kernel, whatever launches first (cache_keys.py)

__all__ = ["launch_split_merge", "merge_kernel", "sm_count"]
