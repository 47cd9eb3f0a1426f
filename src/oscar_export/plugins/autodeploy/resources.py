"""The OSCAR cache of one layer as AutoDeploy cache resources (``get_cache_initializers``).

Written against TensorRT-LLM's ``_torch/auto_deploy/custom_ops/attention_interface.py`` @086f0cea: a backend
returns ``{name: ResourceHandler}`` per source attention node; ``CachedSequenceInterface`` (``shim/interface.py``)
gives the stock paged KV cache only to ``KVPagedResourceHandler`` entries (the C++ ``KVCacheManager``'s pool),
the Mamba state buffers only to ``SSMResourceHandler`` / ``CausalConvResourceHandler``, and allocates every other
handler locally through its ``allocate(sequence_info)`` (``_allocate_unmanaged_resources``). The OSCAR pools are
of the last kind:

* per sequence slot (``StateResourceHandler``: ``[max_num_state_slots, *shape]``, indexed by ``slot_idx``):
  the BF16 sink ``[H_kv, S0, D]`` and recent ring ``[H_kv, C, D]`` of K and V (``KVCacheLayout.sink_shape`` /
  ``recent_shape``), and ``nonfinite`` ``[1]`` int32, set when a NaN/Inf key or value reached the slot;
* per page (:class:`page_pool_class`, paged: it counts in AutoDeploy's cache resize through ``bytes_per_token``):
  the INT2 (or 4-bit key) codes and fp16 params of K and V, ``[num_blocks, ...]`` of ``layout.key_codes_shape``
  etc. Page ``n`` of a sequence is its AutoDeploy block ``n`` (``cache_loc``), so ``tokens_per_block`` must be
  the layout's page size: :meth:`allocate` refuses any other.

With no ``KVPagedResourceHandler`` in the graph the interface builds a one-layer, one-head placeholder
``KVCacheManager`` whose blocks are the page ids (``_build_kv_cache_kwargs`` with no managed KV resources). Only
names here; nothing imports TensorRT-LLM (``up`` is the interface module, or the tests' stand-in of it).
"""

from __future__ import annotations

import math

import torch

#: cache argument names of the cached-attention op, in its signature's order
WINDOW_NAMES = ("sink_k", "sink_v", "recent_k", "recent_v")
POOL_NAMES = ("k_codes", "k_params", "v_codes", "v_params")
FLAG_NAME = "nonfinite"
CACHE_NAMES = WINDOW_NAMES + POOL_NAMES + (FLAG_NAME,)


def page_pool_class(up):
    """``OscarPagePool(up.ResourceHandler)``: one tensor of per-page rows, allocated locally by AutoDeploy."""

    class OscarPagePool(up.ResourceHandler):
        """``[num_blocks, *page_shape]`` of ``dtype``: one pool of one layer (``page_shape`` is one page's)."""

        def __init__(self, page_shape: tuple[int, ...], dtype: torch.dtype, page_size: int) -> None:
            self.page_shape, self.dtype, self.page_size = tuple(page_shape), dtype, page_size

        @property
        def is_paged(self) -> bool:
            return True

        def _get_bytes_per_token(self) -> int:
            """Bytes of one page of this pool over its ``P`` tokens (rounded up: channel-granular params are a
            fixed two rows a page)."""
            return math.ceil(math.prod(self.page_shape) * self.dtype.itemsize / self.page_size)

        def allocate(self, sequence_info) -> torch.Tensor:
            if sequence_info.tokens_per_block != self.page_size:
                raise ValueError(f"tokens_per_block {sequence_info.tokens_per_block}: the OSCAR cache needs "
                                 f"tokens_per_block = its page size {self.page_size} (kv_cache_config)")
            return torch.zeros(sequence_info.num_blocks, *self.page_shape, dtype=self.dtype,
                               device=sequence_info.device)

    OscarPagePool.__qualname__ = OscarPagePool.__name__
    return OscarPagePool


def cache_resources(up, layout) -> dict:
    """``{name: handler}`` of one layer's OSCAR cache in ``layout`` (its key width included), in
    :data:`CACHE_NAMES` order: what the descriptor's ``get_cache_initializers`` returns."""
    pool = page_pool_class(up)
    per_slot = {"sink": layout.sink_shape(1)[1:], "recent": layout.recent_shape(1)[1:]}
    out = {f"{w}_{kv}": up.StateResourceHandler(*per_slot[w], dtype=torch.bfloat16)
           for w in ("sink", "recent") for kv in ("k", "v")}
    p = layout.page_size
    out["k_codes"] = pool(layout.key_codes_shape(1)[1:], torch.uint8, p)
    out["k_params"] = pool(layout.key_params_shape(1)[1:], torch.float16, p)
    out["v_codes"] = pool(layout.value_codes_shape(1)[1:], torch.uint8, p)
    out["v_params"] = pool(layout.value_params_shape(1)[1:], torch.float16, p)
    out[FLAG_NAME] = up.StateResourceHandler(1, dtype=torch.int32)
    assert tuple(out) == CACHE_NAMES
    return out


__all__ = ["CACHE_NAMES", "FLAG_NAME", "POOL_NAMES", "WINDOW_NAMES", "cache_resources", "page_pool_class"]
