"""Writing prompts and chunks into the cache: :func:`write_planned` (a batch of sequences' new tokens, packed, as a
:class:`WritePlan` built once on the host says: sink, whole pages through :func:`write_pages`, the recent ring),
:func:`write_tokens` (one sequence) and its host-side convenience :func:`append_tokens`.
The decode step's one-token write is ``decode_step.py``."""

from __future__ import annotations

from dataclasses import dataclass
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
    state: PagedKV, page_ids, k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform,
) -> None:
    """Quantize ``k, v [N, H_kv, P, D]`` (stored basis) into the pool pages ``page_ids`` (a list or a device
    tensor)."""
    kc, kp = quantize_pages(k, layout.key, transform.k_clip, transform.k_levels)
    vc, vp = quantize_pages(v, layout.value, transform.v_clip, transform.v_levels, "value")
    idx = torch.as_tensor(page_ids, device=state.k_codes.device).long()
    state.k_codes.index_copy_(0, idx, kc)
    state.k_params.index_copy_(0, idx, kp)
    state.v_codes.index_copy_(0, idx, vc)
    state.v_params.index_copy_(0, idx, vp)


@dataclass(frozen=True)
class WritePlan:
    """Where the tokens of one packed write go: every index a write of ``rows`` needs, built once on the host
    (:func:`plan_writes`) and copied to the device once, so a batch of prompts is written with one gather and one
    scatter per destination and one page-quantize call, whatever the number of sequences, and every layer of a
    forward reuses the plan (the split depends on the layout's sink, window and page size only, which all layers
    share).

    Token ``j`` of the packed ``k, v [H_kv, sum T, D]`` belongs to ``rows[token_row[j]]``. Index tensors (int64 on
    the device): ``sink_b, sink_pos, sink_tok`` (tokens into the sink), ``held_b, held_slot`` (recent tokens
    already in the ring that the new pages take), ``page_src [n_pages * P]`` (each new page row: an index into
    ``cat(packed tokens, held tokens)``), ``page_b, page_n`` (each new page's block-table entry), ``ring_b,
    ring_slot, ring_tok`` (new tokens that stay recent), ``token_row``, ``row_b`` (each row's sequence, -1 for a
    row that is not written), ``row_t`` (each row's token count).
    """

    rows: tuple[tuple[int | None, int, int], ...]
    geometry: tuple[int, int, int]  # (sink, recent capacity, page size) of the layout it was built for
    sink_b: torch.Tensor
    sink_pos: torch.Tensor
    sink_tok: torch.Tensor
    held_b: torch.Tensor
    held_slot: torch.Tensor
    page_src: torch.Tensor
    page_b: torch.Tensor
    page_n: torch.Tensor
    ring_b: torch.Tensor
    ring_slot: torch.Tensor
    ring_tok: torch.Tensor
    token_row: torch.Tensor
    row_b: torch.Tensor
    row_t: torch.Tensor

    @property
    def num_pages(self) -> int:
        return self.page_b.shape[0]


def _geometry(layout: KVCacheLayout) -> tuple[int, int, int]:
    return layout.sink, layout.recent_capacity, layout.page_size


def plan_writes(layout: KVCacheLayout, rows, max_pages: int, device) -> WritePlan:
    """The :class:`WritePlan` of ``rows`` ``(b, start, T)`` (sequence, its committed length, new tokens; distinct
    ``b``; ``b`` None: ``T`` packed tokens that are not written), packed in that order. Host arithmetic only
    (:meth:`KVCacheLayout.split`); one host-to-device copy. Raises ``ValueError`` for a sequence listed twice or one
    whose pages overflow ``max_pages``."""
    rows = tuple((None if b is None else int(b), int(s), int(t)) for b, s, t in rows)
    kept = [b for b, _, _ in rows if b is not None]
    if len(set(kept)) != len(kept):
        raise ValueError(f"plan_writes: a sequence is listed twice in {rows}")
    p, s0 = layout.page_size, layout.sink
    idx: dict[str, list[torch.Tensor]] = {name: [] for name in _PLAN_FIELDS}

    def put(name: str, start: int, stop: int | None = None, value: int | None = None) -> None:
        """Append ``start .. stop - 1`` to field ``name`` (or ``start`` copies of ``value``)."""
        idx[name].append(torch.full((start,), value) if value is not None else torch.arange(start, stop))

    total = sum(t for _, _, t in rows)  # page sources: packed token j is j, held token h is total + h
    offset = n_held = 0
    for r, (b, start, t) in enumerate(rows):
        put("token_row", t, value=r)
        put("row_b", 1, value=-1 if b is None else b)
        put("row_t", 1, value=t)
        if b is None:
            offset += t
            continue
        n_sink = max(0, min(s0 - start, t))
        put("sink_b", n_sink, value=b)
        put("sink_pos", start, start + n_sink)
        put("sink_tok", offset, offset + n_sink)
        new0 = offset + n_sink  # packed index of the first new token past the sink
        _, pages0, recent0 = layout.split(start)
        _, pages1, _ = layout.split(start + t)
        first = pages0 * p  # recent index of the oldest recent token before the write
        n_new = 0  # new tokens that go straight into pages
        if pages1 > pages0:
            if pages1 > max_pages:
                raise ValueError(f"write_tokens: sequence {b} needs {pages1} pages, its block table has {max_pages}")
            held = min(recent0, (pages1 - pages0) * p)  # the oldest recent tokens fill the new pages first
            n_new = (pages1 - pages0) * p - held
            put("held_b", held, value=b)
            idx["held_slot"].append(layout.recent_slot(torch.arange(first, first + held)))
            put("page_src", total + n_held, total + n_held + held)
            put("page_src", new0, new0 + n_new)
            put("page_b", pages1 - pages0, value=b)
            put("page_n", pages0, pages1)
            n_held += held
        stay = t - n_sink - n_new  # new token j has recent index first + recent0 + j
        ring0 = first + recent0 + n_new
        put("ring_b", stay, value=b)
        idx["ring_slot"].append(layout.recent_slot(torch.arange(ring0, ring0 + stay)))
        put("ring_tok", new0 + n_new, new0 + n_new + stay)
        offset += t
    fields = [torch.cat(idx[name]) if idx[name] else torch.zeros(0, dtype=torch.long) for name in _PLAN_FIELDS]
    flat = torch.cat(fields).long()
    if torch.device(device).type == "cuda":
        flat = flat.pin_memory()
    parts = flat.to(device, non_blocking=True).split([f.numel() for f in fields])
    return WritePlan(rows, _geometry(layout), **dict(zip(_PLAN_FIELDS, parts)))


_PLAN_FIELDS = ("sink_b", "sink_pos", "sink_tok", "held_b", "held_slot", "page_src", "page_b", "page_n", "ring_b",
                "ring_slot", "ring_tok", "token_row", "row_b", "row_t")


def write_planned(
    state: PagedKV, plan: WritePlan, k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, write: Callable | None = None,
) -> None:
    """Write the packed ``k, v [H_kv, sum T, D]`` (stored basis) as ``plan`` says: sink positions, whole new pages
    quantized through ``write`` (:func:`write_pages`' signature, default; backends pass their kernel) into the
    pages the block table names, and the tokens that stay recent into their ring slots. Lengths are not read or
    changed (the caller's page book commits them). Bytes equal to one :func:`write_tokens` per row."""
    if plan.geometry != _geometry(layout):
        raise ValueError(f"write plan for (sink, recent, page) {plan.geometry}, layout {_geometry(layout)}")
    write = write or write_pages
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [sum T, H_kv, D]
    if plan.sink_b.numel():
        state.sink_k[plan.sink_b, :, plan.sink_pos] = kt[plan.sink_tok].to(state.sink_k.dtype)
        state.sink_v[plan.sink_b, :, plan.sink_pos] = vt[plan.sink_tok].to(state.sink_v.dtype)
    if plan.num_pages:  # before the ring writes: held tokens are read from slots new tokens may take
        p = layout.page_size
        pages = []
        for ring, packed in ((state.recent_k, kt), (state.recent_v, vt)):
            src = torch.cat([packed.to(ring.dtype), ring[plan.held_b, :, plan.held_slot]])  # [T + held, H_kv, D]
            rows = src[plan.page_src].unflatten(0, (plan.num_pages, p))  # [n_pages, P, H_kv, D]
            pages.append(rows.transpose(1, 2).contiguous())  # [n_pages, H_kv, P, D]
        write(state, state.block_table[plan.page_b, plan.page_n], *pages, layout, transform)
    if plan.ring_b.numel():
        state.recent_k[plan.ring_b, :, plan.ring_slot] = kt[plan.ring_tok].to(state.recent_k.dtype)
        state.recent_v[plan.ring_b, :, plan.ring_slot] = vt[plan.ring_tok].to(state.recent_v.dtype)


def nonfinite_rows(plan: WritePlan, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """bool ``[len(plan.rows)]`` on the device: the written rows whose packed ``k, v [H_kv, sum T, D]`` hold a NaN
    or Inf (no host read; a row that is not written: False)."""
    bad_token = ~(torch.isfinite(k).all(dim=2).all(dim=0) & torch.isfinite(v).all(dim=2).all(dim=0))
    counts = torch.zeros(len(plan.rows), dtype=torch.int32, device=k.device)
    return (counts.index_add_(0, plan.token_row, bad_token.to(torch.int32)) > 0) & (plan.row_b >= 0)


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
    ring slots. A T-token write and T single-token decode appends leave identical bytes. One row of
    :func:`write_planned`.
    """
    plan = plan_writes(layout, [(b, start, k.shape[1])], state.block_table.shape[1], state.recent_k.device)
    write_planned(state, plan, k, v, layout, transform, write)


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
