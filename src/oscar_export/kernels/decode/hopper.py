"""The ``"hopper"`` decode backend: the Gluon kernel (``kernels/decode/hopper_kernel.py``) over mma16 pages.

The wrapper around the kernel: what it reads (:func:`checked_pages_per_split`: ``checks.check_hopper_layout`` and
the other checks, made when a cache or a setup is made, never inside a traced step), how it is launched (the launch
plan's wave rule for the pages per split, :func:`pages_per_split`; the merge fused into the split kernel's last
program of each (sequence, KV head), counted in :func:`merge_counters`), and :func:`decode_attention`, the eager
entry point with ``reference.decode_attention``'s signature. The split/merge partials layout and the BF16 window
chunks are the portable kernel's (:mod:`.portable`).
"""

from __future__ import annotations

import torch

from ..aot import launch_plan as _plan
from ..checks import check_decode_inputs, check_hopper_device, check_hopper_layout, check_hopper_state
from ..layout import KVCacheLayout, PagedKV
from . import hopper_kernel as _gl
from .splits import launch_split_merge, sm_count

HAVE_GLUON = _gl.HAVE_GLUON
#: (sequence, KV head) pairs one fused-merge launch can count (:func:`merge_counters`); beyond, the merge is launched.
MERGE_COUNTERS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def pages_per_split(batch: int, num_kv_heads: int, max_pages: int, device: torch.device, head_dim: int) -> int:
    """The launch plan's wave rule (``gl_pages_per_split``) on ``device``'s SM count (132 off the GPU)."""
    return _plan.gl_pages_per_split(batch, num_kv_heads, max_pages, sm_count(device), head_dim)


def merge_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """The int32 counters of the fused-merge launches on ``device``: ``MERGE_COUNTERS`` zeros, allocated once and
    never freed (captured CUDA graphs keep their address). Each launch's last program of a (sequence, KV head) sets
    that pair's counter back to zero, so launches in one stream order share them; two streams running fused-merge
    launches at the same time must not.

    The first call must not be inside a CUDA-graph capture (the zero fill would only be recorded): one eager
    launch first, as every warm-up (and ``torch.compile``'s ``reduce-overhead`` warm-up run) does."""
    if pairs > MERGE_COUNTERS:
        raise ValueError(f"hopper decode fused merge: {pairs} (sequence, KV head) pairs, at most {MERGE_COUNTERS}; "
                         f"use fused_merge=False")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("hopper decode fused merge: its counters are allocated by the first launch, which "
                               "must run eagerly, not inside a CUDA-graph capture (run one warm-up step)")
        buf = _COUNTERS[device] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return buf


def checked_pages_per_split(
    q: torch.Tensor, state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor,
    scale: float, out_dtype: torch.dtype, pps: int | None,
) -> int:
    """Every check before a launch (Gluon in this Triton, ``checks.check_hopper_layout``, the packing-independent
    ``checks.check_decode_inputs``, ``checks.check_hopper_device`` on a GPU, ``checks.check_hopper_state``); returns
    the pages per split ``pps``, None filled in by :func:`pages_per_split`."""
    if not HAVE_GLUON:
        raise NotImplementedError("hopper decode: this Triton has no Gluon")
    if q.dim() == 3:  # (other shapes: the input checks below say what is wrong)
        check_hopper_layout(layout, q.shape[1])
    check_decode_inputs(q, state, layout, k_levels, v_levels, scale, out_dtype, pps)
    if q.device.type == "cuda":  # off the GPU the layout checks still run (tests); the launch needs sm_90
        check_hopper_device(q.device)
    check_hopper_state(state)
    if pps is None:
        pps = pages_per_split(q.shape[0], layout.num_kv_heads, state.block_table.shape[-1], q.device, layout.head_dim)
    return pps


def launch(
    q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
    block_table, sink_len, num_pages, recent_len, num_kv_heads: int, page_size: int, sink: int,
    recent_slots: int, scale: float, k_channel: bool, pages_per_split_: int, out_dtype: torch.dtype,
    *, stages: int | None = None, maxnreg: int | None = None, fused_merge: bool | None = None,
) -> torch.Tensor:
    """Launch the split kernel (and the merge, unless fused) on checked inputs, ``q [B, H, D]`` in the stored key
    basis. ``stages``: cp.async page stages
    (None: the plan's ``GL_PAGE_STAGES``); ``maxnreg``: registers a thread (None: the plan's ``gl_occupancy``,
    0: no cap); ``fused_merge`` (None: the plan's ``GL_FUSED_MERGE`` up to ``MERGE_COUNTERS`` pairs)."""
    _, hq, d = q.shape
    stages = _plan.GL_PAGE_STAGES if stages is None else stages
    if stages < 2:
        raise ValueError(f"hopper decode: stages (cp.async page stages) must be >= 2, got {stages}")
    constexprs = _plan.hopper_split_constexprs(
        num_kv_heads, hq // num_kv_heads, d, page_size, sink, recent_slots, k_channel, k_codes.shape[-1] * 8 // d,
        groups=v_params.shape[-2] if v_params.dim() == 5 else 1, sm_scale=scale, stages=stages)
    maxnreg = _plan.gl_occupancy(d)[0] if maxnreg is None else maxnreg
    if maxnreg:  # a launch option of the JIT, passed beside the constexprs
        constexprs["maxnreg"] = int(maxnreg)
    if fused_merge is None:
        fused_merge = _plan.GL_FUSED_MERGE and q.shape[0] * num_kv_heads <= MERGE_COUNTERS
    counters = merge_counters(q.device, q.shape[0] * num_kv_heads) if fused_merge else None
    kernel, plan = ((_gl.FUSED_KERNEL, _plan.DECODE_SPLIT_MERGE_GL) if fused_merge
                    else (_gl.KERNEL, _plan.DECODE_SPLIT_GL))
    return launch_split_merge(
        kernel, plan, q, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes, v_params, k_levels, v_levels,
        block_table, sink_len, num_pages, recent_len, pages_per_split_, out_dtype, constexprs, plan.num_warps,
        plan.num_stages, counters=counters,
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
    stages: int | None = None,
    maxnreg: int | None = None,
    fused_merge: bool | None = None,
) -> torch.Tensor:
    """``reference.decode_attention`` over mma16 pages on a Hopper GPU (arguments as the portable
    ``decode_attention``; ``stages``, ``maxnreg``, ``fused_merge``: :func:`launch`). Returns ``[B, H, D]`` in
    ``out_dtype``, stored value basis. Reads no device value on the host. ``q`` is in the stored key basis (the
    step's rotation, once a step: ``oscar::decode_append``)."""
    pps = checked_pages_per_split(q, state, layout, k_levels, v_levels, scale, out_dtype, pages_per_split)
    return launch(
        q, state.sink_k, state.sink_v, state.recent_k, state.recent_v, state.k_codes, state.k_params,
        state.v_codes, state.v_params, k_levels, v_levels, state.block_table, state.sink_len, state.num_pages,
        state.recent_len, layout.num_kv_heads, layout.page_size, layout.sink, layout.recent_slots, float(scale),
        layout.key.granularity == "channel", pps, out_dtype, stages=stages, maxnreg=maxnreg,
        fused_merge=fused_merge,
    )


__all__ = ["HAVE_GLUON", "MERGE_COUNTERS", "checked_pages_per_split", "decode_attention", "launch", "merge_counters",
           "pages_per_split"]
