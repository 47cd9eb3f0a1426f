"""One attention layer of the OSCAR cache: :class:`OscarLayer`, its paged KV state and its transform.

An :class:`OscarLayer` owns one ``PagedKV`` (``oscar_export.kernels.layout``) in its layout (the cache's base
layout with the layer's key code width and its decode backend's page packing), viewed twice through the cache's
shared :class:`~oscar_export.kernels.pages.PageBook`: as the committed lengths describe it (:attr:`OscarLayer.state`)
and as the step in flight will leave it (:attr:`OscarLayer.step_state`). Its ``LayerTransform`` lives on the device
with :class:`TransformFlags`, which parts of it are the identity (the backends skip those). The whole cache, its
steps and its contract: ``cache.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform

from .cache_layer import OscarCacheLayer
from .ops import CacheOps


@dataclass(frozen=True)
class TransformFlags:
    """Which parts of a ``LayerTransform`` are the identity (decided once, on the host, at cache creation)."""

    keys_identity: bool  # R_K = I, d_K = 1, mu_K = 0
    values_identity: bool  # R_V = I and d_V = 1, or values pre-rotated by the exported checkpoint
    values_centered: bool  # mu_V = 0

    @classmethod
    def of(cls, t: LayerTransform) -> "TransformFlags":
        eye = torch.eye(t.head_dim, device=t.k_rotation.device)
        k_id = bool((t.k_rotation == eye).all() and (t.k_scale == 1).all() and (t.k_mean == 0).all())
        v_id = t.values_prerotated or bool((t.v_rotation == eye).all() and (t.v_scale == 1).all())
        return cls(k_id, v_id, bool((t.v_mean == 0).all()))


class OscarLayer(OscarCacheLayer):
    """One attention layer's mixed-precision paged cache (see the module doc and ``cache.py``'s).

    Args:
        cache: the :class:`OscarCache` this layer belongs to (its book, step plan and layer count).
        index: the layer's index.
        layout, transform: windows, page size and row formats; the layer's transform (moved to the device).
        dtype: float dtype of the windows (the model's).
        ops: the backend (``ops.py``).
    """

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, cache, index: int, layout: KVCacheLayout, transform: LayerTransform,
                 dtype: torch.dtype, ops: CacheOps) -> None:
        super().__init__(cache, index, dtype)
        if (transform.num_kv_heads, transform.head_dim) != (layout.num_kv_heads, layout.head_dim):
            raise ValueError(
                f"transform: expected H_kv={layout.num_kv_heads}, D={layout.head_dim}, "
                f"got H_kv={transform.num_kv_heads}, D={transform.head_dim}"
            )
        book = cache.book
        self.layout = layout
        self.ops = ops
        self.batch_size = book.batch
        self.transform = _contiguous(transform.to(book.device))
        self.flags = TransformFlags.of(self.transform)
        state = PagedKV.allocate(layout, book.batch, book.num_pool_pages, book.max_pages, device=book.device,
                                 dtype=dtype)
        #: the state as the committed lengths describe it (what a reader between steps sees)
        self.state = book.state_view(state, book.committed)
        #: the state as the step in flight will leave it (what that step's attention reads)
        self.step_state = book.state_view(state, book.in_step)
        #: the backend's checked launch plans (``ops.prepare``; None: the backend keeps none)
        self.append_plan = self.decode_plan = None
        if ops.prepare is not None:
            ops.prepare(self)
        self.is_initialized = True

    @property
    def num_kv_heads(self) -> int:
        return self.layout.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layout.head_dim

    # ---- reads ----------------------------------------------------------------------------------------------
    def read_sequence(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What slot ``b`` holds, in token order (sink, pages, recent): ``[H_kv, L, D]`` fp32 K and V, stored basis."""
        from oscar_export.kernels import reference

        return reference.read_sequence(self.state, self.layout, b, self.transform.k_levels, self.transform.v_levels)


def _contiguous(t: LayerTransform) -> LayerTransform:
    from dataclasses import replace

    fields = {n: getattr(t, n).contiguous() for n in t.__dataclass_fields__ if n != "values_prerotated"}
    return replace(t, **fields)


__all__ = ["OscarLayer", "TransformFlags"]
