"""Writing prompts and chunks into the cache: :func:`write_tokens` (``T`` tokens at a committed length: sink,
whole pages through :func:`write_pages`, the recent ring) and its host-side convenience :func:`append_tokens`.
The decode step's one-token write is ``decode_step.py``."""

from __future__ import annotations

from typing import Callable

import torch

from ..layout import KVCacheLayout, PagedKV
from ..transform import LayerTransform
from .page_quant import quantize_pages


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise if ``x`` holds NaN or Inf: one would silently turn a whole page into garbage."""
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"{what}: {bad} non-finite values (NaN/Inf) would enter the cache")


def write_pages(
    state: PagedKV, page_ids: list[int], k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform,
) -> None:
    """Quantize ``k, v [N, H_kv, P, D]`` (stored basis) into the pool pages ``page_ids``."""
    kc, kp = quantize_pages(k, layout.key, transform.k_clip, transform.k_levels)
    vc, vp = quantize_pages(v, layout.value, transform.v_clip, transform.v_levels, "value")
    idx = torch.tensor(page_ids, dtype=torch.long, device=state.k_codes.device)
    state.k_codes.index_copy_(0, idx, kc)
    state.k_params.index_copy_(0, idx, kp)
    state.v_codes.index_copy_(0, idx, vc)
    state.v_params.index_copy_(0, idx, vp)


def write_tokens(
    state: PagedKV,
    b: int,
    start: int,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: KVCacheLayout,
    transform: LayerTransform,
    write: Callable | None = None,
) -> None:
    """Write ``T`` tokens at positions ``start .. start + T - 1`` of sequence ``b`` (a prompt or a chunk).

    Args:
        state: the cache; its lengths are not read or changed (the caller's page book commits them):
            ``start`` is the committed length of ``b``.
        k, v: ``[H_kv, T, D]`` in the stored basis.
        write: page quantizer with :func:`write_pages`' signature (default); backends pass their kernel.
    Positions below ``S0`` go to the sink; every page that ``layout.split(start + T)`` has and
    ``layout.split(start)`` has not is quantized whole from the recent tokens it takes (those already in
    the ring, then the new ones) into ``block_table[b, n]``; the new tokens that stay recent go to their
    ring slots. A T-token write and T single-token decode appends leave identical bytes.
    """
    write = write or write_pages
    t = k.shape[1]
    s0 = layout.sink
    n_sink = max(0, min(s0 - start, t))
    if n_sink:
        state.sink_k[b, :, start : start + n_sink] = k[:, :n_sink].to(state.sink_k.dtype)
        state.sink_v[b, :, start : start + n_sink] = v[:, :n_sink].to(state.sink_v.dtype)
    k, v = k[:, n_sink:].to(state.recent_k.dtype), v[:, n_sink:].to(state.recent_v.dtype)
    _, pages0, recent0 = layout.split(start)
    _, pages1, _ = layout.split(start + t)
    p = layout.page_size
    first = pages0 * p  # recent index of the oldest recent token before the write
    dev = state.recent_k.device
    n_new = 0  # new tokens that go straight into pages
    if pages1 > pages0:
        if pages1 > state.block_table.shape[1]:
            raise ValueError(f"write_tokens: sequence {b} needs {pages1} pages, its block table has "
                             f"{state.block_table.shape[1]}")
        n_page_rows = (pages1 - pages0) * p
        held = min(recent0, n_page_rows)  # the oldest recent tokens fill the new pages first
        n_new = n_page_rows - held
        slots = layout.recent_slot(torch.arange(first, first + held, device=dev))
        kk = torch.cat([state.recent_k[b][:, slots], k[:, :n_new]], dim=1)  # [H_kv, n_pages * P, D]
        vv = torch.cat([state.recent_v[b][:, slots], v[:, :n_new]], dim=1)
        h, d = kk.shape[0], kk.shape[2]
        kk = kk.reshape(h, pages1 - pages0, p, d).transpose(0, 1).contiguous()  # [n_pages, H_kv, P, D]
        vv = vv.reshape(h, pages1 - pages0, p, d).transpose(0, 1).contiguous()
        write(state, state.block_table[b, pages0:pages1].tolist(), kk, vv, layout, transform)
    # the other new tokens stay recent: new token j has recent index first + recent0 + j
    if k.shape[1] > n_new:
        idx0 = first + recent0 + n_new
        slots = layout.recent_slot(torch.arange(idx0, idx0 + k.shape[1] - n_new, device=dev))
        state.recent_k[b][:, slots] = k[:, n_new:]
        state.recent_v[b][:, slots] = v[:, n_new:]


def append_tokens(
    state: PagedKV,
    b: int,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: KVCacheLayout,
    transform: LayerTransform,
    allocate: Callable[[], int] | None = None,
    write: Callable | None = None,
) -> None:
    """Host-side convenience around :func:`write_tokens`: append ``k, v [H_kv, T, D]`` (stored basis) at the end
    of sequence ``b`` and advance its lengths in ``state`` (for tests and hosts that keep their own lengths;
    the caches commit through a page book instead).

    ``allocate`` (optional) returns a free pool page id for each new page, written into the block table
    first; without it the block table already names the pages. Raises on NaN/Inf before writing.
    """
    check_finite(k, "keys")
    check_finite(v, "values")
    length = int(state.sink_len[b]) + int(state.num_pages[b]) * layout.page_size + int(state.recent_len[b])
    sink, pages, recent = layout.split(length + k.shape[1])
    if pages > state.block_table.shape[1]:
        raise ValueError(f"append: sequence {b} needs {pages} pages, its block table has {state.block_table.shape[1]}")
    if allocate is not None:
        for n in range(int(state.num_pages[b]), pages):
            state.block_table[b, n] = allocate()
    write_tokens(state, b, length, k, v, layout, transform, write)
    state.sink_len[b], state.num_pages[b], state.recent_len[b] = sink, pages, recent
