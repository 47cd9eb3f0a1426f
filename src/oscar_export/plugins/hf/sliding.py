"""Sliding-window layers beside the OSCAR cache: a plain model-dtype ring of the last ``W`` tokens per slot.

Gemma 3 interleaves local layers (each query sees the ``W = config.sliding_window`` most recent positions,
itself included: key ``j`` is visible from query ``i`` iff ``i - W < j <= i``, transformers'
``sliding_window_overlay``) with global layers. Only the global layers hold a long context, so only they use
the OSCAR cache (``cache.py``); a local layer keeps its short window at full precision in a
:class:`SlidingLayer`:

    k, v   [B, H_kv, W, D]   model dtype; position ``p`` of slot ``b`` lives in ring entry ``p mod W``

A query at position ``n`` needs positions ``n - W + 1 .. n``: the ``W - 1`` previous ones are in the ring and
the new token overwrites entry ``n mod W``, which held position ``n - W`` — no longer visible to anyone. So a
decode step that is not committed (a NaN/Inf elsewhere, a full slot) left every entry the committed length
reads untouched, as the OSCAR layers guarantee. The layer shares the OSCAR cache's page book (one length per
slot, on the device): a decode step reads the position from it and decides nothing on the host.

Calibration and export leave these layers alone: the artifact stores identity transforms for them (nothing of
theirs is quantized or rotated, ``calibration/pipeline.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oscar_export.kernels.pages import STATUS_NONFINITE

from .cache_layer import OscarCacheLayer


class SlidingLayer(OscarCacheLayer):
    """One sliding-window attention layer's BF16 ring (see the module doc); duck-types ``OscarLayer``'s cache side.

    Args:
        cache: the ``OscarCache`` this layer belongs to (its book, slots and layer count).
        index: the layer's index.
        num_kv_heads, head_dim, window: H_kv, D and the sliding window W.
        dtype: the model's float dtype.
    """

    is_compileable = True
    is_sliding = True
    is_croppable = False

    def __init__(self, cache, index: int, num_kv_heads: int, head_dim: int, window: int, dtype: torch.dtype) -> None:
        if window <= 0:
            raise ValueError(f"sliding window: expected > 0, got {window}")
        super().__init__(cache, index, dtype)
        book = cache.book
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = window
        shape = (book.batch, num_kv_heads, window, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=book.device)  # [B, H_kv, W, D]
        self.v = torch.zeros(shape, dtype=dtype, device=book.device)
        self.is_initialized = True

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def token_bytes(self) -> int:
        """Bytes of one held token (K and V, all KV heads)."""
        return 2 * self.num_kv_heads * self.head_dim * self.k.element_size()


# ---- attention --------------------------------------------------------------------------------------------


def sliding_attend(layer: SlidingLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   padding: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attend ``T`` new tokens over ``layer``'s window and write them (the sliding twin of ``attention.attend``).

    Args:
        q: ``[B, H, T, D]``; k, v: ``[B, H_kv, T, D]`` post-RoPE, model dtype.
        padding: ``[B, >= T]`` True = real token, or None.
    Returns:
        ``[B, H, T, D]`` in the query dtype.
    """
    cache = layer.cache
    b, _, t, _ = q.shape
    if t == 1 and b == cache.book.batch:
        return _decode(layer, q, k, v, scale)
    plan = cache.begin_prompt(t, padding) if layer.index == 0 else cache.plan
    if plan is None:
        raise RuntimeError("OscarCache: a prompt reached a layer after the first without a plan (layer skipped?)")
    out = torch.zeros_like(q)
    writes = []
    for row, (slot, idx, start) in enumerate(zip(plan.slots, plan.real, plan.starts)):
        qr, kr, vr = (x[row : row + 1] if idx is None else x[row : row + 1, :, idx] for x in (q, k, v))
        for name, x in (("keys", kr), ("values", vr)):
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"{name} of sequence slot {slot} (layer {layer.index}): non-finite values "
                                 "(NaN/Inf) would enter the cache")
        n = kr.shape[2]
        held = min(start, layer.window - 1)  # previous positions still visible to the first new token
        pos_old = torch.arange(start - held, start, device=q.device)
        ring_k = layer.k[slot : slot + 1][:, :, pos_old % layer.window]
        ring_v = layer.v[slot : slot + 1][:, :, pos_old % layer.window]
        pos_k = torch.arange(start - held, start + n, device=q.device)
        pos_q = torch.arange(start, start + n, device=q.device)
        mask = (pos_k[None, :] <= pos_q[:, None]) & (pos_k[None, :] > pos_q[:, None] - layer.window)  # [n, held + n]
        o = _sdpa(qr, torch.cat([ring_k, kr.to(layer.dtype)], 2), torch.cat([ring_v, vr.to(layer.dtype)], 2),
                  mask[None, None], scale)
        if idx is None:
            out[row] = o[0].to(out.dtype)
        else:
            out[row][:, idx] = o[0].to(out.dtype)
        keep = min(n, layer.window)  # the last W new tokens are all a later query can see
        writes.append((slot, torch.arange(start + n - keep, start + n, device=q.device) % layer.window,
                       kr[0, :, n - keep :], vr[0, :, n - keep :]))
    for slot, entries, kk, vv in writes:  # every row checked before the first write of this layer
        layer.k[slot][:, entries] = kk.to(layer.dtype)
        layer.v[slot][:, entries] = vv.to(layer.dtype)
    if layer.index == cache.num_layers - 1:
        cache.commit_prompt(t)
    return out


def _decode(layer: SlidingLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One token per slot, on the device: write entry ``n mod W`` (``n`` = the committed length), attend over
    the ``min(n + 1, W)`` entries that hold positions ``n - W + 1 .. n``."""
    cache = layer.cache
    book = cache.book
    if layer.index == 0:
        cache.begin_decode()
    finite = torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1)
    book.flag((~finite).to(torch.int32) * STATUS_NONFINITE)
    pos = book.seq_len.long()  # [B] the new token's position (committed length)
    bi = torch.arange(book.batch, device=layer.device)
    entry = pos % layer.window
    layer.k[bi, :, entry] = k[:, :, 0].to(layer.dtype)
    layer.v[bi, :, entry] = v[:, :, 0].to(layer.dtype)
    valid = torch.arange(layer.window, device=layer.device)[None, :] <= pos[:, None]  # [B, W]
    if layer.index == cache.num_layers - 1:
        cache.commit_decode()
    return _sdpa(q, layer.k, layer.v, valid[:, None, None, :], scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """GQA ``scaled_dot_product_attention`` of ``q [B, H, T, D]`` over ``k, v [B, H_kv, S, D]`` with a bool mask
    broadcastable to ``[B, H, T, S]`` (True = attend), in the query dtype."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)


__all__ = ["SlidingLayer", "sliding_attend"]
