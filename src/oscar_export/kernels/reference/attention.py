"""Attention over the mixed-precision cache in float32: :func:`masked_attention` (grouped-query, any mask), the
decode step (:func:`decode_attention`) and a prefill chunk attending to the cache and causally to itself
(:func:`chunk_attention`)."""

from __future__ import annotations

import torch

from ..layout import KVCacheLayout, PagedKV
from .context import gather_context


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention in float32.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, H_kv, Tk, D]``; mask: ``[B, Tq, Tk]`` bool (True = attend).
    Returns:
        ``[B, H, Tq, D]`` float32. Rows with nothing to attend give zeros.
    """
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(b, hkv, (h // hkv) * tq, d)
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [B, H_kv, g*Tq, Tk]
    s = s.view(b, hkv, h // hkv, tq, -1).masked_fill(~mask[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.matmul(p.view(b, hkv, (h // hkv) * tq, -1), v.float())
    return o.view(b, h, tq, d)


def decode_attention(
    q: torch.Tensor,
    state: PagedKV,
    layout: KVCacheLayout,
    k_levels: torch.Tensor,
    v_levels: torch.Tensor,
    scale: float,
    memo: dict | None = None,
) -> torch.Tensor:
    """One decode step over sink + INT2 pages + recent, in the stored basis.

    Args:
        q: ``[B, H, D]`` queries already in the stored key basis (``LayerTransform.transform_queries``).
        state: the layer's cache, the new token already appended.
        memo: one layer's dict kept between its steps in eager host code (:func:`gather_context_memo`), or None.
    Returns:
        ``[B, H, D]`` float32 in the stored value basis (``LayerTransform.restore_output`` undoes it).
    """
    k, v, valid = gather_context(state, layout, k_levels, v_levels, memo)
    return masked_attention(q.unsqueeze(2), k, v, valid[:, None, :], scale).squeeze(2)


def chunk_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    state: PagedKV,
    layout: KVCacheLayout,
    k_levels: torch.Tensor,
    v_levels: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A prefill chunk attending to the cache as stored (INT2 history, BF16 windows) and causally to itself.

    Args:
        q: ``[B, H, Tq, D]`` stored basis; k_new, v_new: ``[B, H_kv, Tq, D]`` stored basis (full precision).
        state: the cache before this chunk is written.
    Returns:
        ``[B, H, Tq, D]`` float32, stored value basis. Scores are formed a block of queries at a time.
    """
    k, v, valid = gather_context(state, layout, k_levels, v_levels)
    b, h, tq, _ = q.shape
    k, v = torch.cat([k, k_new.float()], 2), torch.cat([v, v_new.float()], 2)
    tk = k.shape[2]
    # query blocks keep the scores at most ~2^26 elements: memory linear in the history, not [Tq, Tk]
    block = max(1, min(tq, (1 << 26) // max(1, b * h * tk)))
    out = []
    for t0 in range(0, tq, block):
        t1 = min(tq, t0 + block)
        causal = torch.arange(tq, device=q.device)[None, :] <= torch.arange(t0, t1, device=q.device)[:, None]
        mask = torch.cat([valid[:, None, :].expand(-1, t1 - t0, -1), causal[None].expand(b, -1, -1)], dim=2)
        out.append(masked_attention(q[:, :, t0:t1], k, v, mask, scale))
    return torch.cat(out, dim=2)
