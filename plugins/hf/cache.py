"""The OSCAR KV cache as a transformers ``Cache``: one pre-allocated paged layer per attention layer.

Each :class:`OscarLayer` owns one ``PagedKV`` (``oscar_export.kernels.layout``): per-sequence BF16 (model
dtype) sink and recent windows ``[B, H_kv, S0 | W + P, D]`` and a pool of INT2 pages shared by the ``B``
sequences, handed out by a :class:`PageAllocator` (free list). Everything stored is in the transformed
basis of the layer's ``LayerTransform``.

The layer keeps host-side mirrors of each sequence's length and page ids, so the decode step decides
every slot, demotion and page on the host and never reads a length back from the device (demotion itself
runs the reference quantizer, which checks for NaN/Inf, once every P tokens).

transformers calls ``cache.update(k, v, layer_idx)`` right before the attention function. ``update`` writes
nothing: it returns a :class:`LayerStep` in place of the key tensor, and the ``"oscar"`` attention function
(``attention.py``) reads the history, attends and then writes the new tokens. A model must therefore run
with ``attn_implementation="oscar"`` (``enable_oscar`` sets it) to use this cache.

``get_seq_length`` is transformers' view: the number of input columns (padding included) seen so far,
equal for every sequence. Each sequence's real length (pads stripped) is :meth:`OscarCache.sequence_lengths`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar_export.kernels import reference
from oscar_export.kernels.layout import KVCacheLayout, PagedKV, check_pages_fit
from oscar_export.kernels.transform import LayerTransform

from .ops import CacheOps, get_ops


class PoolExhausted(ValueError):
    """The page pool has no free page for a write; raised before anything is written."""


class PageAllocator:
    """Free list of the page ids ``0 .. num_pages - 1`` of one layer's pool."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages: expected > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise PoolExhausted(f"page pool full: all {self.num_pages} pages are in use")
        page = self._free.pop()
        self._used.add(page)
        return page

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise ValueError(f"release: page {page} is not allocated")
            self._used.remove(page)
            self._free.append(page)


@dataclass
class LayerStep:
    """What :meth:`OscarLayer.update` hands the attention function in place of the key tensor.

    Args:
        layer: the cache layer of this attention layer.
        key, value: ``[B, H_kv, T, D]`` the new tokens, post-RoPE, model basis, model dtype.
    """

    layer: "OscarLayer"
    key: torch.Tensor
    value: torch.Tensor


class OscarLayer(CacheLayerMixin):
    """One attention layer's mixed-precision paged cache (see the module doc).

    Args:
        layout: windows, page size and row formats.
        transform: the layer's ``LayerTransform`` (moved to ``device``).
        batch_size: B sequences.
        max_length: most tokens one sequence may hold.
        pool_pages: pages in the pool (default: enough for B sequences of ``max_length``).
        overcommit: allow a pool smaller than B * pages(max_length) (sequences share it; a write that finds
            no free page raises :class:`PoolExhausted`).
        device, dtype: where and in which float dtype the windows live (fp32 on CPU, BF16 on GPU).
        ops: the backend (``ops.py``).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(
        self, layout: KVCacheLayout, transform: LayerTransform, batch_size: int, max_length: int,
        pool_pages: int | None = None, overcommit: bool = False, device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32, ops: CacheOps | None = None,
    ) -> None:
        super().__init__()
        if batch_size <= 0 or max_length <= 0:
            raise ValueError(f"batch_size and max_length: expected > 0, got {batch_size}, {max_length}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a float dtype for the windows, got {dtype}")
        if (transform.num_kv_heads, transform.head_dim) != (layout.num_kv_heads, layout.head_dim):
            raise ValueError(
                f"transform: expected H_kv={layout.num_kv_heads}, D={layout.head_dim}, "
                f"got H_kv={transform.num_kv_heads}, D={transform.head_dim}"
            )
        max_pages = max(1, layout.pages_for(max_length))
        if pool_pages is None:
            pool_pages = max(1, batch_size * layout.pages_for(max_length))
        elif not overcommit:
            check_pages_fit(layout, pool_pages, batch_size, max_length)
        self.layout = layout
        self.transform = transform.to(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.dtype = dtype
        self.ops = ops if ops is not None else get_ops("torch")
        self.state = PagedKV.allocate(layout, batch_size, pool_pages, max_pages, device=device, dtype=dtype)
        self.device = self.state.sink_k.device
        self.allocator = PageAllocator(pool_pages)
        self.lengths = [0] * batch_size  # host mirror: real tokens per sequence
        self.pages: list[list[int]] = [[] for _ in range(batch_size)]  # host mirror of the block table
        self.seen = 0  # input columns seen (transformers' view, padding included)
        self.is_initialized = True

    # ---- transformers' CacheLayerMixin interface ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers are allocated up front; only check what arrives."""
        self.check_new(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Record ``T`` new columns and hand the new tokens to the attention function (nothing is written yet).

        Args:
            key_states, value_states: ``[B, H_kv, T, D]`` post-RoPE keys and values, model dtype.
        Returns:
            ``(LayerStep, value_states)``: the ``"oscar"`` attention function expects the step as its key.
        """
        self.check_new(key_states, value_states)
        self.seen += key_states.shape[-2]
        return LayerStep(self, key_states, value_states), value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.max_length

    def get_max_cache_shape(self) -> int:  # transformers 5.17 name
        return self.max_length

    def reset(self) -> None:
        for b in range(self.batch_size):
            self.free(b)
        self.seen = 0

    def offload(self) -> None:  # windows and pool stay where they are
        pass

    def prefetch(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("OscarCache cannot be cropped (INT2 pages cannot be un-demoted)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("OscarCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("OscarCache is allocated for a fixed batch: use num_return_sequences=1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("OscarCache is allocated for a fixed batch")

    # ---- checks ---------------------------------------------------------------------------------------------
    def check_new(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys/values must be ``[B, H_kv, T, D]`` float tensors on the cache's device."""
        shape = (self.batch_size, self.layout.num_kv_heads, None, self.layout.head_dim)
        for name, t in (("key_states", k), ("value_states", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.ndim != 4 or any(e is not None and e != g for e, g in zip(shape, t.shape)):
                want = f"[{shape[0]}, {shape[1]}, T, {shape[3]}]"
                raise ValueError(f"{name}: expected {want}, got {list(t.shape)}")
            if not t.dtype.is_floating_point:
                raise ValueError(f"{name}: expected a float dtype, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name}: expected device {self.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"value_states: expected {list(k.shape)} like the keys, got {list(v.shape)}")

    def _check_room(self, grow: dict[int, int]) -> None:
        """Raise before writing if any sequence would pass ``max_length`` or the pool lacks pages."""
        need = 0
        for b, n in grow.items():
            old, new = self.lengths[b], self.lengths[b] + n
            if new > self.max_length:
                raise ValueError(
                    f"sequence {b}: {new} tokens exceed the cache's max_length={self.max_length}"
                )
            need += self.layout.pages_for(new) - self.layout.pages_for(old)
        if need > self.allocator.free_count:
            raise PoolExhausted(
                f"page pool full: this write needs {need} pages, {self.allocator.free_count} of "
                f"{self.allocator.num_pages} are free"
            )

    def _allocate(self, b: int) -> int:
        page = self.allocator.allocate()
        self.pages[b].append(page)
        return page

    # ---- writes ---------------------------------------------------------------------------------------------
    def write(self, rows: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append tokens to several sequences (prefill or a chunk); all checks run before any write.

        Args:
            rows: ``{b: (k [H_kv, n_b, D], v [H_kv, n_b, D])}`` in the stored basis (fp32).
        """
        rows = {b: kv for b, kv in rows.items() if kv[0].shape[1] > 0}
        for b, (k, v) in rows.items():
            reference.check_finite(k, f"keys of sequence {b}")
            reference.check_finite(v, f"values of sequence {b}")
        self._check_room({b: k.shape[1] for b, (k, _) in rows.items()})
        for b, (k, v) in rows.items():
            self.ops.append_tokens(
                self.state, b, k, v, self.layout, self.transform, lambda b=b: self._allocate(b)
            )
            self.lengths[b] += k.shape[1]

    def append_decode(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one token to every sequence, deciding slots on the host (no device read-back).

        Args:
            k, v: ``[B, H_kv, 1, D]`` stored basis.
        """
        lay = self.layout
        self._check_room({b: 1 for b in range(self.batch_size)})
        sink_b, sink_t, rec_b, rec_t, demote = [], [], [], [], []
        for b, length in enumerate(self.lengths):
            if length < lay.sink:
                sink_b.append(b)
                sink_t.append(length)
                continue
            _, _, recent = lay.split(length)
            if recent == lay.recent_capacity:
                demote.append(b)
                recent -= lay.page_size
            rec_b.append(b)
            rec_t.append(recent)
        st, p = self.state, lay.page_size
        for b in sink_b:  # sink tokens stay for the whole sequence and are never quantized: check them here
            reference.check_finite(k[b, :, 0], f"keys of sequence {b} (sink)")
            reference.check_finite(v[b, :, 0], f"values of sequence {b} (sink)")
        for b in demote:  # every check before the first write: a failure leaves all sequences as they were
            reference.check_finite(st.recent_k[b, :, :p], f"keys of sequence {b} (demotion)")
            reference.check_finite(st.recent_v[b, :, :p], f"values of sequence {b} (demotion)")
        for b in demote:
            self.ops.demote(st, b, self._allocate(b), lay, self.transform)
        dev = st.sink_k.device
        for buf_k, buf_v, bs, ts in ((st.sink_k, st.sink_v, sink_b, sink_t), (st.recent_k, st.recent_v, rec_b, rec_t)):
            if bs:
                bi = torch.tensor(bs, device=dev)
                ti = torch.tensor(ts, device=dev)
                buf_k[bi, :, ti] = k[bi, :, 0].to(buf_k.dtype)  # [n, H_kv, D]
                buf_v[bi, :, ti] = v[bi, :, 0].to(buf_v.dtype)
        for b in range(self.batch_size):
            self.lengths[b] += 1
        self._sync_lengths()

    def _sync_lengths(self) -> None:
        """Copy the host mirrors of the lengths to the device (host -> device only)."""
        split = [self.layout.split(n) for n in self.lengths]
        for name, i in (("sink_len", 0), ("num_pages", 1), ("recent_len", 2)):
            getattr(self.state, name).copy_(torch.tensor([s[i] for s in split], dtype=torch.int32))

    def free(self, b: int) -> None:
        """Forget sequence ``b`` and return its pages to the pool."""
        if not 0 <= b < self.batch_size:
            raise IndexError(f"sequence index: expected 0..{self.batch_size - 1}, got {b}")
        self.allocator.release(self.pages[b])
        self.pages[b] = []
        self.lengths[b] = 0
        reference.reset_sequence(self.state, b)

    # ---- reads ----------------------------------------------------------------------------------------------
    def is_empty(self) -> bool:
        return not any(self.lengths)

    def context(self) -> PagedKV:
        """The state with the block table cut to the most pages any sequence holds (a view, no copy)."""
        m = max(1, max(len(p) for p in self.pages))
        return replace(self.state, block_table=self.state.block_table[:, :m])

    def read_sequence(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What sequence ``b`` holds, in order (sink, pages, recent): ``[H_kv, L, D]`` fp32 K and V, stored basis."""
        t = self.transform
        k, v, valid = reference.gather_context(self.context(), self.layout, t.k_levels, t.v_levels)
        keep = valid[b]
        return k[b][:, keep], v[b][:, keep]


class OscarCache(Cache):
    """The whole model's OSCAR cache: one :class:`OscarLayer` per attention layer.

    Args:
        layout: the layout every layer shares.
        transforms: one ``LayerTransform`` per layer.
        batch_size, max_length, pool_pages, overcommit, device, dtype: see :class:`OscarLayer`.
        backend: ``"torch"`` (reference), ``"torch.compile"`` or a ``CacheOps`` (``ops.py``).
    """

    def __init__(
        self, layout: KVCacheLayout, transforms: Sequence[LayerTransform], batch_size: int, max_length: int,
        *, pool_pages: int | None = None, overcommit: bool = False, device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32, backend: str | CacheOps = "torch",
    ) -> None:
        if len(transforms) == 0:
            raise ValueError("transforms: expected one LayerTransform per layer, got none")
        ops = get_ops(backend)
        layers = [
            OscarLayer(layout, t, batch_size, max_length, pool_pages, overcommit, device, dtype, ops)
            for t in transforms
        ]
        super().__init__(layers=layers)
        self.layout = layout
        self.max_length = max_length

    def free(self, b: int) -> None:
        """Forget sequence ``b`` in every layer."""
        for layer in self.layers:
            layer.free(b)

    def sequence_lengths(self) -> list[int]:
        """Real tokens (pads stripped) held by each sequence."""
        return list(self.layers[0].lengths)

    def kv_bytes(self) -> int:
        """Bytes the cached tokens occupy now, all layers (windows at BF16, pages INT2), from the layout."""
        return len(self.layers) * sum(self.layout.sequence_bytes(n) for n in self.sequence_lengths())

    def bf16_bytes(self) -> int:
        """Bytes the same tokens would occupy in a BF16 cache."""
        return len(self.layers) * sum(n * self.layout.bf16_token_bytes() for n in self.sequence_lengths())


__all__ = ["LayerStep", "OscarCache", "OscarLayer", "PageAllocator", "PoolExhausted"]
