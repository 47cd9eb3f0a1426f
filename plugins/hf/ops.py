"""The backend seam: the few cache ops the Hugging Face path calls, gathered in one small object.

The HF cache and attention function never call a kernel directly; they call ``ops.<name>`` with the
reference signatures of ``oscar_export.kernels.reference``:

=====================  ==========================================================================================
``append_tokens``      ``(state, b, k [H_kv, T, D], v, layout, transform, allocate)``: prefill / chunk write
``demote``             ``(state, b, page_id, layout, transform)``: oldest P recent tokens -> one INT2 page
``decode_attention``   ``(q [B, H, D], state, layout, k_levels, v_levels, scale) -> [B, H, D]``
``chunk_attention``    ``(q [B, H, T, D], k_new, v_new, state, layout, k_levels, v_levels, scale) -> [B, H, T, D]``
=====================  ==========================================================================================

Backends: ``"torch"`` (the reference functions, eager), ``"torch.compile"`` (the two attention functions
wrapped in ``torch.compile``; the writers stay eager, they are host-side bookkeeping), ``"triton"`` (the
Triton kernels, ``triton_backend.py``; BF16 windows, i.e. a BF16 model on a GPU). A new backend is one more
entry in :data:`BACKENDS`: a function returning a :class:`CacheOps` whose functions keep the reference
signatures, so the HF path and its tests need no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from oscar_export.kernels import reference


@dataclass(frozen=True)
class CacheOps:
    """One backend's implementation of the four cache ops (reference signatures, see the module doc)."""

    name: str
    append_tokens: Callable
    demote: Callable
    decode_attention: Callable
    chunk_attention: Callable


def _torch_ops() -> CacheOps:
    return CacheOps(
        name="torch",
        append_tokens=reference.append_tokens,
        demote=reference.demote,
        decode_attention=reference.decode_attention,
        chunk_attention=reference.chunk_attention,
    )


def _compiled_ops() -> CacheOps:
    import torch

    return CacheOps(
        name="torch.compile",
        append_tokens=reference.append_tokens,
        demote=reference.demote,
        decode_attention=torch.compile(reference.decode_attention, dynamic=True),
        chunk_attention=torch.compile(reference.chunk_attention, dynamic=True),
    )


def _triton_ops() -> CacheOps:
    from .triton_backend import triton_ops  # Triton kernels (BF16 windows); ImportError without triton

    return triton_ops()


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


__all__ = ["BACKENDS", "CacheOps", "get_ops"]
