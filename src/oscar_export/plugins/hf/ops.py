"""The backend seam: the four cache ops the Hugging Face path calls, gathered in one small object.

The HF cache and attention function never call a kernel directly; they call ``ops.<name>(layer, ...)``,
where ``layer`` (an ``OscarLayer``) carries the layout, the transform on the device, its identity flags and
precomputed kernel arguments:

=====================  ==========================================================================================
``write_planned``      ``(layer, state, plan, k_s [H_kv, sum T, D], v_s)``: a forward's prompts / chunks, packed,
                       stored basis, as ``plan`` (``reference.plan_writes``, the cache's, made once a forward) says
``decode_append``      ``(layer, state, k [B, H_kv, D], v, q [B, H, D], status) -> q_s [B, H, D]``: the decode
                       step's write; keys and queries post-RoPE in the model basis, values rotated
                       (``attention.rotate_values``), device only. Returns the step's queries in the stored key
                       basis, ``transform_queries(q)`` (fp32; ``q`` itself where the keys are the identity): the
                       query rotation once a step (docs/design.md §3.6)
``decode_attention``   ``(layer, q_s [B, H, D], state, scale) -> [B, H, D]`` stored value basis; ``q_s`` what
                       ``decode_append`` returned (no backend rotates queries here)
``chunk_attention``    ``(layer, q_s [1, H, T, D], k_s, v_s, state, scale) -> [1, H, T, D]`` stored basis
=====================  ==========================================================================================

Backends: ``"torch"`` (the reference, eager), ``"torch.compile"`` (the reference with the two decode ops
compiled), ``"triton"`` (the Triton kernels, ``triton_backend.py``; BF16 windows, i.e. a BF16 model on a
GPU). A new backend is a module of these functions (as ``triton_backend.py``, which imports nothing from here)
and one more entry in :data:`BACKENDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from oscar_export.kernels import reference

from . import triton_backend


@dataclass(frozen=True)
class CacheOps:
    """One backend's implementation of the four cache ops (signatures in the module doc)."""

    name: str
    write_planned: Callable
    decode_append: Callable
    decode_attention: Callable
    chunk_attention: Callable
    #: ``(layer) -> None``, called once per layer when a cache is made (checks and launch plans), or None
    prepare: Callable | None = None


def ref_write_planned(layer, state, plan, k_s: torch.Tensor, v_s: torch.Tensor) -> None:
    reference.write_planned(state, plan, k_s, v_s, layer.layout, layer.transform)


def ref_decode_append(layer, state, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                      status: torch.Tensor) -> torch.Tensor:
    tr = layer.transform
    k_s = tr.transform_keys(k.unsqueeze(2)).squeeze(2)  # [B, H_kv, D] fp32
    v_s = v.float() - tr.v_mean
    # eager on the CPU a host read is free: skip the candidate page's quantization in the steps that demote nothing
    idle = not k.is_cuda and not torch.compiler.is_compiling()
    reference.decode_append(state, k_s, v_s, status, layer.layout, tr, skip_idle=idle)
    return q if layer.flags.keys_identity else tr.transform_queries(q.unsqueeze(2)).squeeze(2)


def ref_decode_attention(layer, q_s: torch.Tensor, state, scale: float) -> torch.Tensor:
    tr = layer.transform
    memo = None  # eager on the CPU: the layer keeps its dequantized pages between steps (host reads are free)
    if not q_s.is_cuda and not torch.compiler.is_compiling():
        memo = layer.__dict__.setdefault("dequantized_pages", {})
    return reference.decode_attention(q_s.float(), state, layer.layout, tr.k_levels, tr.v_levels, scale, memo)


def ref_chunk_attention(layer, q_s, k_s, v_s, state, scale: float) -> torch.Tensor:
    tr = layer.transform
    return reference.chunk_attention(q_s, k_s, v_s, state, layer.layout, tr.k_levels, tr.v_levels, scale)


def _torch_ops() -> CacheOps:
    return CacheOps("torch", ref_write_planned, ref_decode_append, ref_decode_attention, ref_chunk_attention)


def _compiled_ops() -> CacheOps:
    return CacheOps("torch.compile", ref_write_planned, torch.compile(ref_decode_append),
                    torch.compile(ref_decode_attention), ref_chunk_attention)


def _triton_ops() -> CacheOps:
    """The Triton kernels (BF16 windows); ``ImportError`` without Triton. Chunks attend with the reference."""
    triton_backend.require_triton()
    return CacheOps("triton", triton_backend.write_planned, triton_backend.decode_append,
                    triton_backend.decode_attention, ref_chunk_attention, triton_backend.prepare)


#: backend name -> factory. Add a backend here, not by patching the cache.
BACKENDS: dict[str, Callable[[], CacheOps]] = {
    "torch": _torch_ops,
    "torch.compile": _compiled_ops,
    "triton": _triton_ops,
}


def get_ops(backend: str | CacheOps = "torch") -> CacheOps:
    """The :class:`CacheOps` of ``backend`` (a name from :data:`BACKENDS`, or a ready ``CacheOps``)."""
    if isinstance(backend, CacheOps):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend]()


__all__ = ["BACKENDS", "CacheOps", "get_ops", "ref_chunk_attention", "ref_decode_append", "ref_decode_attention",
           "ref_write_planned"]
