"""``backend="triton"``: the Hugging Face cache ops on the Triton kernels (signatures in ``ops.py``, which gathers
them into the backend's ``CacheOps``).

=====================  ====================================================================================
``write_planned``      ``reference.write_planned``' bookkeeping with whole pages quantized by
                       ``kernels.quant_pack.write_pages`` (bit-exact with the reference quantizer)
``decode_append``      ``oscar::decode_append``: one launch (key transform fused unless it is the identity,
                       NaN/Inf check, demotion when due, the token) that also returns the step's queries in the
                       stored key basis (fp32; the queries themselves where the keys are the identity)
``decode_attention``   ``oscar::decode_attention``: the layer's decode backend (``kernels.decode.select_backend``,
                       by its page packing): split + merge over stored-basis queries (no rotation in a split
                       program), output in the model dtype
``chunk_attention``    the reference's (``ops.ref_chunk_attention``; no Triton chunked-prefill kernel yet)
=====================  ====================================================================================

The windows must be BF16 (the cache's GPU default). Both decode ops are ``torch.library`` custom ops, so
``torch.compile`` traces them without a graph break; every check of a launch is made by :func:`prepare`, when the
cache is made, so a traced step reads no pointer and no device value.
"""

from __future__ import annotations

import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform


def _write(state: PagedKV, page_ids, k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
           transform: LayerTransform) -> None:
    """Quantize ``k, v [N, H_kv, P, D]`` (stored basis, last dim contiguous) into pool pages ``page_ids``."""
    from oscar_export.kernels.quant_pack import write_pages

    ids = torch.as_tensor(page_ids, device=state.k_codes.device).int()
    write_pages(k, ids, state.k_codes, state.k_params, layout, layout.key, transform.k_clip, transform.k_levels)
    write_pages(v, ids, state.v_codes, state.v_params, layout, layout.value, transform.v_clip, transform.v_levels,
                operand="value")


def write_planned(layer, state, plan, k_s: torch.Tensor, v_s: torch.Tensor) -> None:
    reference.write_planned(state, plan, k_s, v_s, layer.layout, layer.transform, write=_write)


def prepare(layer) -> None:
    """Check and plan the layer's two decode-step launches (``kernels.triton_ops.plan_append`` / ``plan_decode``)
    on tensors of the step's shapes, kept on the layer (``append_plan``, ``decode_plan``). Needs the model's query
    heads (``cache.num_heads``); without them the first decode step plans (eager only)."""
    if layer.cache.num_heads is None:
        return
    lay = layer.layout
    kv = torch.empty(layer.batch_size, lay.num_kv_heads, lay.head_dim, dtype=layer.dtype, device=layer.device)
    q = torch.empty(layer.batch_size, layer.cache.num_heads, lay.head_dim, dtype=layer.dtype, device=layer.device)
    layer.append_plan = _plan_append(layer, layer.state, kv, kv, q, layer.cache.book.status)
    layer.decode_plan = _plan_decode(layer, _stored_queries(layer, q), layer.step_state, q.dtype)


def _plan_append(layer, state, k, v, q, status):
    from oscar_export.kernels import triton_ops

    fused = not layer.flags.keys_identity or not layer.flags.values_centered
    return triton_ops.plan_append(state, k, v, status, layer.layout, layer.transform, fused_transform=fused,
                                  q=None if layer.flags.keys_identity else q)


def _stored_queries(layer, q: torch.Tensor) -> torch.Tensor:
    """A tensor like the stored-basis queries ``decode_append`` returns for queries like ``q``."""
    return q if layer.flags.keys_identity else torch.empty(q.shape, dtype=torch.float32, device=q.device)


def _plan_decode(layer, q_s, state, out_dtype):
    from oscar_export.kernels import triton_ops

    tr = layer.transform
    return triton_ops.plan_decode(q_s, state, layer.layout, tr.k_levels, tr.v_levels, 1.0, out_dtype=out_dtype)


def decode_append(layer, state, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                  status: torch.Tensor) -> torch.Tensor:
    from oscar_export.kernels import triton_ops

    plan = getattr(layer, "append_plan", None)
    if plan is None:  # a layer made without the model's heads (or a stand-in): plan now, eagerly
        plan = _plan_append(layer, state, k, v, q, status)
    q_s = triton_ops.run_append(plan, state, k, v, status, layer.transform, q)
    return q if q_s is None else q_s


def decode_attention(layer, q_s: torch.Tensor, state, scale: float) -> torch.Tensor:
    from oscar_export.kernels import triton_ops

    plan = getattr(layer, "decode_plan", None)
    if plan is None:  # a layer made without the model's heads (or a stand-in): plan now, output in its dtype
        plan = _plan_decode(layer, q_s, state, getattr(layer, "dtype", q_s.dtype))
    tr = layer.transform
    return triton_ops.run_decode(plan, q_s, state, tr.k_levels, tr.v_levels, scale)


def require_triton() -> None:
    """Raise the ``ImportError`` that names the extra to install where Triton is not installed."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError("backend 'triton' needs Triton: pip install 'oscar-export[triton]'") from e


__all__ = ["decode_append", "decode_attention", "prepare", "require_triton", "write_planned"]
