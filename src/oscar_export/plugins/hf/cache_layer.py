"""What every layer of an ``OscarCache`` answers to transformers' ``CacheLayerMixin`` the same way.

Both layer kinds (``oscar_layer.OscarLayer``, the OSCAR paged cache; ``sliding.SlidingLayer``, a model-dtype ring)
belong to one ``OscarCache``: their length, mask sizes and reset are the cache's (its page book); both refuse
what a fixed-batch cache cannot do (beam reordering, batch resizing), and both hand the attention function a
:class:`LayerStep` from ``update``, after one check of the new tokens (``check_new``), the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin


@dataclass
class LayerStep:
    """What a layer's ``update`` hands the attention function in place of the key tensor.

    Args:
        layer: the cache layer of this attention layer (``oscar_layer.OscarLayer`` or ``sliding.SlidingLayer``).
        key, value: ``[B, H_kv, T, D]`` the new tokens, post-RoPE, model basis, model dtype.
    """

    layer: "OscarCacheLayer"
    key: torch.Tensor
    value: torch.Tensor

    def __getattr__(self, name: str):
        """Only attention that is not OSCAR's reads a key tensor's attributes from a step: say so."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"an OscarCache reached attention that is not OSCAR's (it read .{name} of a key): the model was switched "
            f"back (setup.restore(), or the end of `with enable_oscar(...)`) or was never switched; use the cache "
            f"only while its setup is enabled")


class OscarCacheLayer(CacheLayerMixin):
    """The cache-wide part of a layer's ``CacheLayerMixin`` interface; ``self.cache`` is the ``OscarCache``, and a
    layer has ``device``, ``num_kv_heads`` and ``head_dim``.

    Args:
        cache: the ``OscarCache`` the layer belongs to (its book, slots and layer count).
        index: the layer's index.
        dtype: the model's float dtype.
    """

    def __init__(self, cache, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cache = cache
        self.index = index
        self.dtype = dtype
        self.device = cache.book.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hand the new tokens to the attention function (nothing is written here).

        Args:
            key_states, value_states: ``[B, H_kv, T, D]`` post-RoPE keys and values, model dtype.
        Returns:
            ``(LayerStep, value_states)``: the ``"oscar"`` attention function expects the step as its key.
        """
        self.check_new(key_states, value_states)
        return LayerStep(self, key_states, value_states), value_states

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("OscarCache cannot be cropped (INT2 pages cannot be un-demoted)")

    def check_new(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys/values must be ``[B', H_kv, T, D]`` float tensors on the cache's device, ``B'`` the number
        of slots this forward writes (all ``B``, or those of ``OscarCache.select``)."""
        rows = len(self.cache.active_slots)
        shape = (rows, self.num_kv_heads, None, self.head_dim)
        for name, t in (("key_states", k), ("value_states", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.ndim != 4 or any(e is not None and e != g for e, g in zip(shape, t.shape)):
                want = f"[{shape[0]}, {shape[1]}, T, {shape[3]}]"
                raise ValueError(f"{name}: expected {want}, got {list(t.shape)} (batch = the cache's active slots)")
            if not t.dtype.is_floating_point:
                raise ValueError(f"{name}: expected a float dtype, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name}: expected device {self.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"value_states: expected {list(k.shape)} like the keys, got {list(v.shape)}")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers are allocated up front; only check what arrives."""
        self.check_new(key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.book.max_length, 0

    def get_seq_length(self) -> torch.Tensor:
        return self.cache.seen

    def get_max_length(self) -> int:
        return self.cache.book.max_length

    def get_max_cache_shape(self) -> int:  # transformers 5.17 name
        return self.cache.book.max_length

    def reset(self) -> None:
        self.cache.reset()

    def offload(self) -> None:  # buffers stay where they are
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("OscarCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("OscarCache is allocated for a fixed batch: use num_return_sequences=1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("OscarCache is allocated for a fixed batch")


__all__ = ["LayerStep", "OscarCacheLayer"]
