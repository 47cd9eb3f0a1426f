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
``kernels.quant_pack.decode_step_update``.
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
    p = layout.page_size
    n = int(state.num_pages[b])
    if int(state.recent_len[b]) < p:
        raise RuntimeError(f"demote: sequence {b} holds {int(state.recent_len[b])} recent tokens, needs {p}")
    if n >= state.block_table.shape[1]:
        raise ValueError(f"demote: sequence {b} already uses all {n} block-table slots")
    _write(state, [page_id], state.recent_k[b : b + 1, :, :p], state.recent_v[b : b + 1, :, :p], layout, transform)
    state.block_table[b, n] = page_id
    state.num_pages[b] = n + 1
    state.recent_k[b, :, :-p] = state.recent_k[b, :, p:].clone()
    state.recent_v[b, :, :-p] = state.recent_v[b, :, p:].clone()
    state.recent_len[b] -= p


def append_tokens(state: PagedKV, b: int, k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
                  transform: LayerTransform, allocate: Callable[[], int]) -> None:
    """``reference.append_tokens`` (same cache, bit for bit) with pages written by the Triton quantizer.

    Args:
        k, v: ``[H_kv, T, D]`` stored basis.
    """
    reference.check_finite(k, "keys")
    reference.check_finite(v, "values")
    t, i = k.shape[1], 0
    s0 = int(state.sink_len[b])
    if s0 < layout.sink and int(state.recent_len[b]) == 0 and int(state.num_pages[b]) == 0:
        n = min(layout.sink - s0, t)
        state.sink_k[b, :, s0 : s0 + n] = k[:, :n].to(state.sink_k.dtype)
        state.sink_v[b, :, s0 : s0 + n] = v[:, :n].to(state.sink_v.dtype)
        state.sink_len[b] = s0 + n
        i = n
    cap, p = layout.recent_capacity, layout.page_size
    while i < t:
        r = int(state.recent_len[b])
        if r == cap:
            demote(state, b, allocate(), layout, transform)
            continue
        if r == 0 and t - i > cap:  # whole pages that will certainly be demoted go straight to INT2
            full = -(-(t - i - cap) // p)
            n_pg = int(state.num_pages[b])
            if n_pg + full > state.block_table.shape[1]:
                raise ValueError(f"append: sequence {b} needs more than {state.block_table.shape[1]} pages")
            ids = [allocate() for _ in range(full)]
            h, d = k.shape[0], k.shape[2]
            # rows pass through the recent buffer's dtype first, exactly as the one-by-one path does
            kk = k[:, i : i + full * p].to(state.recent_k.dtype).reshape(h, full, p, d).transpose(0, 1).contiguous()
            vv = v[:, i : i + full * p].to(state.recent_v.dtype).reshape(h, full, p, d).transpose(0, 1).contiguous()
            _write(state, ids, kk, vv, layout, transform)
            state.block_table[b, n_pg : n_pg + full] = torch.tensor(ids, dtype=torch.int32)
            state.num_pages[b] = n_pg + full
            i += full * p
            continue
        n = min(cap - r, t - i)
        state.recent_k[b, :, r : r + n] = k[:, i : i + n].to(state.recent_k.dtype)
        state.recent_v[b, :, r : r + n] = v[:, i : i + n].to(state.recent_v.dtype)
        state.recent_len[b] = r + n
        i += n


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
