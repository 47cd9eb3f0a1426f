"""The ``"oscar"`` attention function and its mask function (registered by ``enable_oscar``).

transformers calls, per layer: ``cache.update(k, v)`` (our :class:`~.cache.OscarLayer` returns a
:class:`~.cache.LayerStep`), then ``oscar_attention(module, q, step, v, mask)``. What happens depends on the
chunk:

* **prefill** (``T > 1``, cache empty): plain causal attention at full precision over the real tokens
  (model basis), then the chunk is written: sink, INT2 pages, recent (``ops.append_tokens``).
* **chunk** (``T > 1``, cache not empty): the chunk reads the history as stored (INT2 pages, windows) and
  itself causally at full precision (``ops.chunk_attention``, stored basis), then is written.
* **decode** (``T == 1``): the token is appended first (demoting P tokens when recent is full), then
  ``ops.decode_attention`` reads sink + INT2 + recent.

Queries and keys enter the stored basis with ``LayerTransform.transform_queries/keys`` (post-RoPE), values
with ``transform_values``; the output returns to the model basis with ``restore_output``.

Padding: the mask function hands the attention the 2D padding mask ``[B, past + T]`` (True = real token)
unchanged. Prefill and chunks strip pad tokens per sequence; a decode step treats every new token as real
(``generate`` always appends real tokens) and so never reads the mask back from the device.
"""

from __future__ import annotations

import torch

from oscar_export.kernels import reference

from .cache import LayerStep, OscarLayer

#: the name registered with transformers' AttentionInterface and AttentionMaskInterface.
ATTENTION_NAME = "oscar"


def oscar_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs):
    """Mask function: the 2D padding mask ``[B, kv_length]`` bool (or None); the cache builds the rest."""
    return attention_mask


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
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("oscar attention does not support sliding-window layers")
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
        ``[B, H, T, D]`` float32, model basis.
    """
    b, h, t, d = q.shape
    lay, tr, ops = layer.layout, layer.transform, layer.ops
    if h % lay.num_kv_heads or d != lay.head_dim or q.shape[0] != layer.batch_size:
        raise ValueError(
            f"query: expected [{layer.batch_size}, a multiple of {lay.num_kv_heads}, T, {lay.head_dim}], "
            f"got {list(q.shape)}"
        )
    scale = d**-0.5 if scale is None else scale
    k_s, v_s = tr.transform_keys(k), tr.transform_values(v)  # [B, H_kv, T, D] fp32
    if t == 1:
        layer.append_decode(k_s, v_s)
        q_s = tr.transform_queries(q)[:, :, 0]  # [B, H, D]
        o = ops.decode_attention(q_s, layer.context(), lay, tr.k_levels, tr.v_levels, scale)
        return tr.restore_output(o.unsqueeze(2))

    real = _real_token_indices(padding, b, t, q.device)  # None: every token is real
    if layer.is_empty():
        out = _prefill_attention(q, k, v, padding, scale)
    else:
        out = _chunk_attention(layer, tr.transform_queries(q), k_s, v_s, real, scale)
    if real is None:
        layer.write({i: (k_s[i], v_s[i]) for i in range(b)})
    else:
        layer.write({i: (k_s[i][:, idx], v_s[i][:, idx]) for i, idx in enumerate(real)})
    return out


def _real_token_indices(
    padding: torch.Tensor | None, b: int, t: int, device: torch.device
) -> list[torch.Tensor] | None:
    """Per sequence, the indices of the real tokens among the last ``t`` columns (None: all real)."""
    if padding is None:
        return None
    if padding.ndim != 2 or padding.shape[0] != b or padding.shape[1] < t:
        raise ValueError(f"attention_mask: expected a 2D padding mask [{b}, >= {t}], got {list(padding.shape)}")
    valid = padding[:, -t:].to(device=device, dtype=torch.bool)
    if bool(valid.all()):
        return None
    return [row.nonzero().squeeze(1) for row in valid]


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Plain causal attention at full precision, pad keys masked: ``[B, H, T, D]`` fp32, model basis."""
    b, _, t, _ = q.shape
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[None].expand(b, t, t)  # [B, Tq, Tk]
    if padding is not None:
        mask = mask & padding[:, -t:].to(device=q.device, dtype=torch.bool)[:, None, :]
    return reference.masked_attention(q, k, v, mask, scale)


def _chunk_attention(
    layer: OscarLayer, q_s: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor,
    real: list[torch.Tensor] | None, scale: float,
) -> torch.Tensor:
    """A chunk over the stored history and itself; pads are squeezed out (real tokens moved left) first.

    Args:
        q_s: ``[B, H, T, D]``; k_s, v_s: ``[B, H_kv, T, D]`` stored basis.
    Returns:
        ``[B, H, T, D]`` fp32, model basis (zeros at pad positions).
    """
    lay, tr, ops = layer.layout, layer.transform, layer.ops
    ctx = layer.context()
    if real is None:
        o = ops.chunk_attention(q_s, k_s, v_s, ctx, lay, tr.k_levels, tr.v_levels, scale)
        return tr.restore_output(o)
    b, h, t, d = q_s.shape
    n = max(1, max(len(idx) for idx in real))
    qc = q_s.new_zeros(b, h, n, d)
    kc = k_s.new_zeros(b, k_s.shape[1], n, d)
    vc = v_s.new_zeros(b, v_s.shape[1], n, d)
    for i, idx in enumerate(real):  # right padding: causality keeps real queries off the pads
        qc[i, :, : len(idx)] = q_s[i][:, idx]
        kc[i, :, : len(idx)] = k_s[i][:, idx]
        vc[i, :, : len(idx)] = v_s[i][:, idx]
    oc = tr.restore_output(ops.chunk_attention(qc, kc, vc, ctx, lay, tr.k_levels, tr.v_levels, scale))
    out = oc.new_zeros(b, h, t, d)
    for i, idx in enumerate(real):
        out[i][:, idx] = oc[i, :, : len(idx)]
    return out


__all__ = ["ATTENTION_NAME", "attend", "oscar_attention", "oscar_mask"]
