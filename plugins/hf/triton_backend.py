"""``backend="triton"``: the Hugging Face cache ops on the Triton kernels (reference signatures, ``ops.py``).

=====================  ====================================================================================
``append_tokens``      same bookkeeping as ``reference.append_tokens``; whole pages quantized by
                       ``kernels.quant_pack.write_pages`` (bit-exact with the reference quantizer)
``demote``             the oldest P recent rows quantized in place by the same kernel, then the window shifts
``decode_attention``   ``kernels.triton_ops.decode_attention`` (the ``oscar::decode_attention`` custom op,
                       so ``torch.compile`` traces it without a graph break); fp32 output like the reference
``chunk_attention``    the reference (no Triton chunked-prefill kernel yet)
=====================  ====================================================================================

The windows must be BF16 (the cache's GPU default). Writers read counters on the host, like the reference
(the HF cache keeps host mirrors anyway); the graph-capturable per-step update is
``kernels.decode_step.decode_step_update``.
"""

from __future__ import annotations

from typing import Callable

import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform

from .ops import CacheOps


def _write(state: PagedKV, page_ids: list[int], k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
           transform: LayerTransform) -> None:
    """Quantize ``k, v [N, H_kv, P, D]`` (stored basis, last dim contiguous) into pool pages ``page_ids``."""
    from oscar_export.kernels.quant_pack import write_pages

    ids = torch.tensor(page_ids, dtype=torch.int32, device=state.k_codes.device)
    write_pages(k, ids, state.k_codes, state.k_params, layout, layout.key, transform.k_clip, transform.k_levels)
    write_pages(v, ids, state.v_codes, state.v_params, layout, layout.value, transform.v_clip, transform.v_levels)


def demote(state: PagedKV, b: int, page_id: int, layout: KVCacheLayout, transform: LayerTransform) -> None:
    """``reference.demote`` with the Triton quantizer reading the recent window in place."""
    reference.demote(state, b, page_id, layout, transform, write=_write)


def append_tokens(state: PagedKV, b: int, k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
                  transform: LayerTransform, allocate: Callable[[], int]) -> None:
    """``reference.append_tokens`` (same bookkeeping, same cache bit for bit) with the Triton page quantizer.

    Args:
        k, v: ``[H_kv, T, D]`` stored basis.
    """
    reference.append_tokens(state, b, k, v, layout, transform, allocate, write=_write)


def decode_attention(q: torch.Tensor, state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor,
                     v_levels: torch.Tensor, scale: float) -> torch.Tensor:
    """``reference.decode_attention`` through the ``oscar::decode_attention`` op: ``[B, H, D]`` fp32."""
    from oscar_export.kernels import triton_ops

    return triton_ops.decode_attention(q.contiguous(), state, layout, k_levels.contiguous(),
                                       v_levels.contiguous(), float(scale))


def triton_ops() -> CacheOps:
    """The ``"triton"`` :class:`CacheOps` (needs ``triton``; BF16 windows)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError("backend 'triton' needs Triton: pip install 'oscar-export[triton]'") from e
    return CacheOps(name="triton", append_tokens=append_tokens, demote=demote, decode_attention=decode_attention,
                    chunk_attention=reference.chunk_attention)


__all__ = ["append_tokens", "decode_attention", "demote", "triton_ops"]
