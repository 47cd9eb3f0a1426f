"""The ``"oscar"`` attention function and its mask function (registered by ``enable_oscar``).

transformers calls, per layer: ``cache.update(k, v)`` (our :class:`~.oscar_layer.OscarLayer` returns a
:class:`~.cache_layer.LayerStep`), then ``oscar_attention(module, q, step, v, mask)``. What happens depends on the
forward:

* **decode** (``T == 1`` for every slot): device-only. The first layer begins the step on the page book;
  each layer appends its token (``ops.decode_append``: key transform, NaN/Inf check, demotion when due; the
  same launch turns the step's queries into the stored key basis, once a step) and attends over sink + INT2
  pages + recent (``ops.decode_attention`` on those queries); the last layer commits. No host read: the whole
  model step is capturable in one CUDA graph.
* **prompt** (``T > 1``, or the slots of ``cache.select``; a slot with nothing stored): the real tokens attend
  causally at full precision through ``scaled_dot_product_attention`` in the model dtype (flash /
  memory-efficient: O(T) memory, no ``[T, T]`` mask), then are written, every row of the forward in one
  ``ops.write_planned`` (sink, INT2 pages, recent ring; the cache's plan, made once a forward).
* **chunk** (``T > 1``, a slot that holds tokens): the chunk reads the history as stored and itself causally
  (``ops.chunk_attention``, stored basis, in query blocks), then is written.

Sliding-window layers (Gemma 3's local layers; the family table lists them) hold a plain model-dtype ring of
their window instead (``sliding.py``), attended the same three ways at full precision.

Padding: the mask function hands prompts the 2D padding mask ``[B, past + T]`` (True = real token); a prompt
keeps only each row's real tokens. A decode step treats every new token as real (``generate`` appends real
tokens) and gets no mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oscar_export.kernels import reference

from .cache_layer import LayerStep
from .oscar_layer import OscarLayer
from .sliding import SlidingLayer, sliding_attend

#: the name registered with transformers' AttentionInterface and AttentionMaskInterface.
ATTENTION_NAME = "oscar"


def oscar_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs):
    """Mask function: the 2D padding mask ``[B, kv_length]`` bool for prompts; None for a decode step."""
    return None if q_length == 1 else attention_mask


def oscar_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the OSCAR cache.

    Args:
        query: ``[B, H, T, D]`` post-RoPE queries.
        key: the :class:`LayerStep` returned by the cache (it carries the new keys and values).
        attention_mask: the 2D padding mask from :func:`oscar_mask`, or None.
    Returns:
        ``([B, T, H, D]`` in the query dtype``, None)``.
    """
    if not isinstance(key, LayerStep):
        raise TypeError(
            "attn_implementation='oscar' needs an OscarCache: call generate/forward with "
            "past_key_values=oscar.make_cache(...) (got keys of type "
            f"{type(key).__name__})"
        )
    if dropout:
        raise NotImplementedError("oscar attention is inference-only (dropout must be 0)")
    window = kwargs.get("sliding_window")
    if isinstance(key.layer, SlidingLayer):
        if window != key.layer.window:
            raise ValueError(f"layer {key.layer.index}: the model slides over {window} tokens, its cache layer over "
                             f"{key.layer.window} (make the cache with the setup of this model)")
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        out = sliding_attend(key.layer, query, key.key, key.value, attention_mask, scale)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    if window is not None:
        raise NotImplementedError(
            f"layer {key.layer.index} has sliding-window attention (window {window}) but its cache layer is an OSCAR "
            "layer: the family table (calibration/families.py) did not list it as sliding"
        )
    out = attend(key.layer, query, key.key, key.value, attention_mask, scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def attend(
    layer: OscarLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attend ``T`` new tokens over ``layer``'s cache and write them (see the module doc).

    Args:
        q: ``[B, H, T, D]``; k, v: ``[B, H_kv, T, D]`` post-RoPE, model basis.
        padding: ``[B, >= T]`` True = real token (its last ``T`` columns are the new tokens), or None.
    Returns:
        ``[B, H, T, D]`` model basis (model dtype for a decode step).
    """
    b, h, t, d = q.shape
    lay = layer.layout
    if h % lay.num_kv_heads or d != lay.head_dim or b != len(layer.cache.active_slots):
        raise ValueError(
            f"query: expected [{len(layer.cache.active_slots)}, a multiple of {lay.num_kv_heads}, T, "
            f"{lay.head_dim}], got {list(q.shape)}"
        )
    scale = d**-0.5 if scale is None else float(scale)
    if t == 1 and b == layer.cache.book.batch:  # a decode step (a 1-token prompt into selected slots is a prompt)
        return _decode(layer, q, k, v, scale)
    return _prompt(layer, q, k, v, padding, scale)


def _decode(layer: OscarLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    cache, ops = layer.cache, layer.ops
    if layer.index == 0:
        cache.begin_decode()
    q_s = ops.decode_append(layer, layer.state, k[:, :, 0].contiguous(), rotate_values(layer, v[:, :, 0]),
                            q[:, :, 0].contiguous(), cache.book.status)  # the queries in the stored key basis
    if layer.index == cache.num_layers - 1:
        cache.commit_decode()
    o = ops.decode_attention(layer, q_s, layer.step_state, scale)  # [B, H, D]
    return restore_output(layer, o.unsqueeze(2))


def rotate_values(layer: OscarLayer, v: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, D]`` values -> ``v @ R_V * d_V`` (no-op for pre-rotated or identity values); contiguous.
    The mean ``mu_V`` is removed by the writer."""
    if layer.flags.values_identity:
        return v.contiguous()
    tr = layer.transform
    return (torch.matmul(v.float().unsqueeze(2), tr.v_rotation).squeeze(2) * tr.v_scale).contiguous()


def restore_output(layer: OscarLayer, o: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` output in the stored value basis -> model basis (``LayerTransform.restore_output``,
    skipped where it is the identity)."""
    if layer.flags.values_identity and layer.flags.values_centered:
        return o
    return layer.transform.restore_output(o)


def _prompt(layer: OscarLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    cache, tr, ops = layer.cache, layer.transform, layer.ops
    t = q.shape[2]
    plan = cache.begin_prompt(t, padding) if layer.index == 0 else cache.plan
    if plan is None:
        raise RuntimeError("OscarCache: a prompt reached a layer after the first without a plan (layer skipped?)")
    batched = all(s == 0 for s in plan.starts) and all(r is None for r in plan.real)
    out = causal_sdpa(q, k, v, scale) if batched else torch.zeros_like(q)  # one call when no row is special
    writes = []
    for row, (slot, idx, start) in enumerate(zip(plan.slots, plan.real, plan.starts)):
        qr, kr, vr = (x[row : row + 1] if idx is None else x[row : row + 1, :, idx] for x in (q, k, v))
        k_s, v_s = tr.transform_keys(kr)[0], tr.transform_values(vr)[0]  # [H_kv, n, D] fp32 stored basis
        if not batched:
            if start == 0:
                o = causal_sdpa(qr, kr, vr, scale)
            else:  # a chunk over what the slot holds
                o_s = ops.chunk_attention(layer, tr.transform_queries(qr), k_s[None], v_s[None],
                                          _one_slot(layer, slot), scale)
                o = tr.restore_output(o_s)
            if idx is None:
                out[row] = o[0].to(out.dtype)
            else:
                out[row][:, idx] = o[0].to(out.dtype)
        writes.append((k_s, v_s))
    k_all, v_all = (torch.cat([w[i] for w in writes], dim=1) for i in (0, 1))  # packed in row order
    if not bool(torch.isfinite(k_all).all() & torch.isfinite(v_all).all()):  # before any write; the row named
        for slot, (k_s, v_s) in zip(plan.slots, writes):
            reference.check_finite(k_s, f"keys of sequence slot {slot} (layer {layer.index})")
            reference.check_finite(v_s, f"values of sequence slot {slot} (layer {layer.index})")
    ops.write_planned(layer, layer.state, plan.writes, k_all, v_all)  # one write for the batch
    if layer.index == cache.num_layers - 1:
        cache.commit_prompt(t)
    return out


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of ``q [B, H, T, D]`` over ``k, v [B, H_kv, T, D]`` in their dtype, through
    ``scaled_dot_product_attention`` (flash / memory-efficient on CUDA: no ``[T, T]`` tensor)."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale)


def _one_slot(layer: OscarLayer, slot: int):
    """The committed state of one slot as a batch-1 ``PagedKV`` (views)."""
    from dataclasses import fields, replace

    st = layer.state
    sl = slice(slot, slot + 1)
    per_seq = ("sink_k", "sink_v", "recent_k", "recent_v", "block_table", "sink_len", "num_pages", "recent_len")
    return replace(st, **{f.name: getattr(st, f.name)[sl] for f in fields(st) if f.name in per_seq})


__all__ = ["ATTENTION_NAME", "attend", "causal_sdpa", "oscar_attention", "oscar_mask", "restore_output",
           "rotate_values"]
