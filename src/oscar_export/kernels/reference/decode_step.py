"""The decode step's cache write, one token a sequence: :func:`decode_append`, all on the device (no host read,
no value-dependent branch: the form the Triton twin ``kernels/decode_step.py`` matches and ``torch.compile``
captures), and :func:`decode_append_host`, the same bytes in eager host code (the CPU path)."""

from __future__ import annotations

import torch

from ..layout import KVCacheLayout, PagedKV
from ..pages import STATUS_NONFINITE
from ..transform import LayerTransform
from .page_quant import quantize_pages


def decode_append(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, skip_idle: bool = False,
) -> None:
    """Append one token to every sequence, demoting a page where the recent window is full: the decode step's
    write, all on the device (no host read, no value-dependent branch; compiles with ``fullgraph=True``).

    Args:
        state: the cache with its *committed* lengths (the page book's ``committed``), unchanged here.
        k, v: ``[B, H_kv, D]`` new rows in the stored basis.
        status: ``[B]`` int32 step status (``pages.STATUS_*``); a slot whose status is nonzero, or whose rows
            hold NaN/Inf (then ``STATUS_NONFINITE`` is set here), writes nothing.
    Where ``recent_len == W + P`` the oldest ``P`` recent tokens (ring slots ``(nP + j) mod C``) are quantized
    into ``block_table[b, n]``, ``n = num_pages``; the token goes to sink slot ``sink_len`` while the sink is
    not full, else to ring slot ``(nP + recent_len) mod C``. Both targets lie beyond the committed lengths.
    Every row writes its candidate page (unchanged where no demotion is due) in one indexed assignment, so the
    rows' ``block_table[b, num_pages[b]]`` must be distinct pages (a cache's reserved pages are; a host pool
    that leaves entries unassigned calls this one row at a time).
    ``skip_idle``: eager host code (the CPU path): :func:`decode_append_host`, which reads the lengths on the host
    and quantizes only the pages that are due (the same bytes; not for graph capture or fullgraph compile).
    """
    if skip_idle:
        return decode_append_host(state, k, v, status, layout, transform)
    bsz = k.shape[0]
    p, s0 = layout.page_size, layout.sink
    finite = torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1)
    status.bitwise_or_((~finite).to(torch.int32) * STATUS_NONFINITE)
    ok = status == 0
    bi = torch.arange(bsz, device=k.device)
    to_sink = state.sink_len < s0
    n = state.num_pages.long()
    # demotion: every slot computes its candidate page, only due slots store it
    due = ok & ~to_sink & (state.recent_len == layout.recent_capacity)
    rows = layout.recent_slot(n[:, None] * p + torch.arange(p, device=k.device))  # [B, P]
    page = state.block_table[bi, n.clamp(max=state.block_table.shape[1] - 1)].long()  # [B]
    for x, fmt, clip, levels, codes, params, operand in _demotions(state, layout, transform):
        rows_x = x[bi[:, None], :, rows].permute(0, 2, 1, 3)  # [B, H_kv, P, D]
        qc, qp = quantize_pages(rows_x, fmt, clip, levels, operand)
        codes[page] = torch.where(due.view(-1, 1, 1, 1), qc, codes[page])
        params[page] = torch.where(due.view(-1, *([1] * (qp.dim() - 1))), qp, params[page])
    # the token
    sink_pos = state.sink_len.long().clamp(max=max(s0 - 1, 0))
    slot = layout.recent_slot(n * p + state.recent_len.long())
    for buf_s, buf_r, x in ((state.sink_k, state.recent_k, k), (state.sink_v, state.recent_v, v)):
        if s0 > 0:
            old = buf_s[bi, :, sink_pos]  # [B, H_kv, D]
            buf_s[bi, :, sink_pos] = torch.where((ok & to_sink).view(-1, 1, 1), x.to(buf_s.dtype), old)
        old = buf_r[bi, :, slot]
        buf_r[bi, :, slot] = torch.where((ok & ~to_sink).view(-1, 1, 1), x.to(buf_r.dtype), old)


def _demotions(state: PagedKV, layout: KVCacheLayout, transform: LayerTransform) -> tuple:
    """``(recent ring, row format, clip, levels, codes pool, params pool, operand)`` of K, then of V."""
    return (
        (state.recent_k, layout.key, transform.k_clip, transform.k_levels, state.k_codes, state.k_params, "key"),
        (state.recent_v, layout.value, transform.v_clip, transform.v_levels, state.v_codes, state.v_params, "value"),
    )


# ---- the decode step in eager host code (the CPU path): the same bytes and tensors, host reads allowed -----------


def decode_append_host(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform,
) -> None:
    """:func:`decode_append` with the lengths and the status read on the host: each slot that writes stores its
    token and, only when one is due, its page (the branch-free form computes every slot's candidate page every
    step). The same bytes as :func:`decode_append` (test); arguments as there."""
    finite = torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1)
    status.bitwise_or_((~finite).to(torch.int32) * STATUS_NONFINITE)
    p, s0, m = layout.page_size, layout.sink, state.block_table.shape[1]
    host = torch.stack([status, state.sink_len, state.num_pages, state.recent_len]).tolist()  # [4][B]
    for b, (st, sink_len, n, recent_len) in enumerate(zip(*host)):
        if st != 0:
            continue
        if sink_len < s0:
            state.sink_k[b, :, sink_len] = k[b]
            state.sink_v[b, :, sink_len] = v[b]
            continue
        if recent_len == layout.recent_capacity:  # the oldest P recent tokens become page n
            page = int(state.block_table[b, min(n, m - 1)])
            slots = layout.recent_slot(torch.arange(n * p, n * p + p, device=k.device))
            for x, fmt, clip, levels, codes, params, operand in _demotions(state, layout, transform):
                qc, qp = quantize_pages(x[b][:, slots][None], fmt, clip, levels, operand)  # of [1, H_kv, P, D]
                codes[page], params[page] = qc[0], qp[0]
        slot = layout.recent_slot(n * p + recent_len)
        state.recent_k[b, :, slot] = k[b]
        state.recent_v[b, :, slot] = v[b]
