"""The cache read back as dense float32 tensors: every sequence at once in slot order (:func:`gather_context`,
its mask :func:`context_mask`, and the eager host form that keeps them between calls, :func:`gather_context_memo`),
or one sequence in token order (:func:`read_sequence`)."""

from __future__ import annotations

import torch

from ..layout import KVCacheLayout, PagedKV
from .page_quant import dequantize_pages

# ---- every sequence in slot order (sink, pages, recent ring) ---------------------------------------------------------


def gather_context(
    state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor, memo: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's cache as dense float32 ``[B, H_kv, S0 + M*P + C, D]`` K and V and a ``[B, T]`` mask.

    Order along T: sink slots, then the ``M = block_table.shape[1]`` page slots, then the recent ring's
    ``C`` slots (ring order, not token order: attention does not care); the mask marks the slots a
    sequence actually holds. ``memo``: the eager host form, :func:`gather_context_memo` (the same tensors).
    """
    if memo is not None:
        return gather_context_memo(state, layout, k_levels, v_levels, memo)
    b, m = state.block_table.shape
    p = layout.page_size
    pool = state.k_codes.shape[0]
    ids = state.block_table.long().clamp(0, pool - 1)  # entries past num_pages are masked below
    k_hist = dequantize_pages(state.k_codes[ids], state.k_params[ids], layout.key, k_levels)  # [B, M, H, P, D]
    v_hist = dequantize_pages(state.v_codes[ids], state.v_params[ids], layout.value, v_levels, "value")
    h, d = layout.num_kv_heads, layout.head_dim
    k_hist = k_hist.permute(0, 2, 1, 3, 4).reshape(b, h, m * p, d)
    v_hist = v_hist.permute(0, 2, 1, 3, 4).reshape(b, h, m * p, d)
    k = torch.cat([state.sink_k.float(), k_hist, state.recent_k.float()], dim=2)
    v = torch.cat([state.sink_v.float(), v_hist, state.recent_v.float()], dim=2)
    return k, v, context_mask(state, layout)


def context_mask(state: PagedKV, layout: KVCacheLayout) -> torch.Tensor:
    """``[B, S0 + M*P + C]`` bool: the slots of :func:`gather_context`'s order that each sequence holds."""
    m, p = state.block_table.shape[1], layout.page_size
    dev = state.block_table.device
    return torch.cat(
        [
            torch.arange(layout.sink, device=dev)[None, :] < state.sink_len[:, None],
            torch.arange(m * p, device=dev)[None, :] < (state.num_pages[:, None] * p),
            recent_valid(layout, state.num_pages, state.recent_len),
        ],
        dim=1,
    )


def recent_valid(layout: KVCacheLayout, num_pages: torch.Tensor, recent_len: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` bool: which recent ring slots hold a token. The ring starts at slot ``(num_pages * P) mod C``
    and holds ``recent_len`` tokens from there (``layout.py``)."""
    c = layout.recent_slots
    start = (num_pages.long() * layout.page_size) % c
    slot = torch.arange(c, device=num_pages.device)
    return (slot[None, :] - start[:, None]) % c < recent_len[:, None]


def gather_context_memo(
    state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor, memo: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gather_context` kept up to date in ``memo`` between calls (one layer's dict, empty at first).

    The memo holds the last call's dense K and V and the codes and params they were dequantized from. A call
    dequantizes again only the page slots whose codes or params changed (in a decode step: the page demoted
    since the last one, or none) and copies the sink and the recent ring in, instead of building every tensor
    anew. It returns the memo's own buffers, equal to :func:`gather_context`'s (each page is the same
    elementwise dequantization: test) and valid until the next call. Reads on the host: not under graph capture.
    """
    b, m = state.block_table.shape
    p, s0, c = layout.page_size, layout.sink, layout.recent_slots
    ids = state.block_table.long().clamp(0, state.k_codes.shape[0] - 1)
    pages = (state.k_codes[ids], state.k_params[ids], state.v_codes[ids], state.v_params[ids])  # [B, M, ...]
    old = memo.get("pages")
    shape = (b, layout.num_kv_heads, s0 + m * p + c, layout.head_dim)
    if old is None or memo["k"].shape != shape or any(x.shape != y.shape for x, y in zip(pages, old)):
        k, v, valid = gather_context(state, layout, k_levels, v_levels)
        memo.update(pages=pages, k=k, v=v)
        return k, v, valid
    k, v = memo["k"], memo["v"]
    if not all(torch.equal(x, y) for x, y in zip(pages, old)):
        changed = torch.zeros(b, m, dtype=torch.bool, device=ids.device)
        for x, y in zip(pages, old):
            changed |= (x != y).flatten(2).any(2)
        kc, kp, vc, vp = (x[changed] for x in pages)  # [n, H_kv, ...]
        k[:, :, s0 : s0 + m * p].unflatten(2, (m, p)).transpose(1, 2)[changed] = dequantize_pages(
            kc, kp, layout.key, k_levels)  # the page slots as [B, M, H_kv, P, D] (a view)
        v[:, :, s0 : s0 + m * p].unflatten(2, (m, p)).transpose(1, 2)[changed] = dequantize_pages(
            vc, vp, layout.value, v_levels, "value")
        memo["pages"] = pages
    for dense, sink, recent in ((k, state.sink_k, state.recent_k), (v, state.sink_v, state.recent_v)):
        dense[:, :, :s0] = sink
        dense[:, :, s0 + m * p :] = recent
    return k, v, context_mask(state, layout)


# ---- one sequence in token order -------------------------------------------------------------------------------------


def read_sequence(
    state: PagedKV, layout: KVCacheLayout, b: int, k_levels: torch.Tensor, v_levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What sequence ``b`` holds in token order (sink, pages, recent): ``[H_kv, L, D]`` fp32 K and V, stored
    basis, ``L`` its length (read on the host from the state's lengths)."""
    sink, pages = int(state.sink_len[b]), int(state.num_pages[b])
    recent = int(state.recent_len[b])
    ids = state.block_table[b, :pages].long()
    k_pg = dequantize_pages(state.k_codes[ids], state.k_params[ids], layout.key, k_levels)  # [n, H, P, D]
    v_pg = dequantize_pages(state.v_codes[ids], state.v_params[ids], layout.value, v_levels, "value")
    h, d, p = layout.num_kv_heads, layout.head_dim, layout.page_size
    slots = layout.recent_slot(torch.arange(pages * p, pages * p + recent, device=state.recent_k.device))
    parts_k = [state.sink_k[b, :, :sink].float(), k_pg.transpose(0, 1).reshape(h, -1, d),
               state.recent_k[b][:, slots].float()]
    parts_v = [state.sink_v[b, :, :sink].float(), v_pg.transpose(0, 1).reshape(h, -1, d),
               state.recent_v[b][:, slots].float()]
    return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)
