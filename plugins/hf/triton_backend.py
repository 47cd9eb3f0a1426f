"""``backend="triton"``: the Hugging Face cache ops on the Triton kernels (signatures in ``ops.py``).

=====================  ====================================================================================
``write_tokens``       ``reference.write_tokens``' bookkeeping with whole pages quantized by
                       ``kernels.quant_pack.write_pages`` (bit-exact with the reference quantizer)
``decode_append``      ``oscar::decode_append``: one launch (key transform fused unless it is the identity,
                       NaN/Inf check, demotion when due, the token)
``decode_attention``   ``oscar::decode_attention`` (linear pages) or ``oscar::decode_attention_v2`` (mma16
                       pages, the layer's ``decode_variant``): split + merge, the query transform fused in
                       the prologue, output in the model dtype
``chunk_attention``    the reference (no Triton chunked-prefill kernel yet)
=====================  ====================================================================================

The windows must be BF16 (the cache's GPU default). Both decode ops are ``torch.library`` custom ops, so
``torch.compile`` traces them without a graph break.
"""

from __future__ import annotations

import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform

from .ops import CacheOps, ref_chunk_attention


def _write(state: PagedKV, page_ids: list[int], k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
           transform: LayerTransform) -> None:
    """Quantize ``k, v [N, H_kv, P, D]`` (stored basis, last dim contiguous) into pool pages ``page_ids``."""
    from oscar_export.kernels.quant_pack import write_pages

    ids = torch.tensor(page_ids, dtype=torch.int32, device=state.k_codes.device)
    write_pages(k, ids, state.k_codes, state.k_params, layout, layout.key, transform.k_clip, transform.k_levels)
    write_pages(v, ids, state.v_codes, state.v_params, layout, layout.value, transform.v_clip, transform.v_levels,
                operand="value")


def write_tokens(layer, state, b: int, start: int, k_s: torch.Tensor, v_s: torch.Tensor) -> None:
    reference.write_tokens(state, b, start, k_s, v_s, layer.layout, layer.transform, write=_write)


def decode_append(layer, state, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor) -> None:
    from oscar_export.kernels import triton_ops

    triton_ops.decode_append(state, k, v, status, layer.layout, layer.transform,
                             fused_transform=not layer.flags.keys_identity or not layer.flags.values_centered,
                             group_removals=layer.group_removals)


def decode_attention(layer, q: torch.Tensor, state, scale: float) -> torch.Tensor:
    from oscar_export.kernels import triton_ops

    tr = layer.transform
    rot = None if layer.flags.keys_identity else (tr.k_rotation, tr.k_scale)
    return triton_ops.decode_attention(q, state, layer.layout, tr.k_levels, tr.v_levels, scale, q_rotation=rot,
                                       out_dtype=q.dtype, pages_per_split=layer.pages_per_split,
                                       variant=layer.decode_variant)


def triton_ops() -> CacheOps:
    """The ``"triton"`` :class:`CacheOps` (needs ``triton``; BF16 windows)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError("backend 'triton' needs Triton: pip install 'oscar-export[triton]'") from e
    return CacheOps("triton", write_tokens, decode_append, decode_attention, ref_chunk_attention)


__all__ = ["decode_append", "decode_attention", "triton_ops", "write_tokens"]
