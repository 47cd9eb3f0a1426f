"""The OSCAR cache inside TensorRT-LLM: a subclass of its ``KVCacheManager`` (NOT EXECUTED in TensorRT-LLM).

The C++ block manager (``self.impl``) stays in charge of admission, scheduling, dummy requests and block
ids; with ``tokens_per_block = P`` each block id is also an INT2 page id (``book.py``). The subclass

* builds the stock pool for a single layer and only as many blocks as ``max_batch_size`` full sequences need
  (``kv_cache_config.max_tokens``), so the BF16 pool TensorRT-LLM allocates shrinks by the layer count;
  UNTESTED in TensorRT-LLM: whether anything besides the attention backend reads the stock pool per layer;
* allocates one ``PagedKV`` per layer (BF16 windows, INT2 pools with one page per C++ block, one shared
  device block table);
* in ``prepare_resources`` gives each request a slot, resets a new sequence's device lengths, copies its C++
  block ids into the block table and writes the batch's slots, in batch order, into the device buffer
  ``step_slots`` the attention reads; dummy requests (``add_dummy_requests``: CUDA-graph warmup, capture and
  batch padding) own no slot: their rows point at the book's scratch row, which never stores a token. All of it
  is stream-ordered device writes, so under the overlap executor loop (``prepare_resources(N+1)`` before
  ``update_resources(N)``) nothing the forward of step N reads changes under it, and demotion happens inside
  the forward (``AotCacheOps.decode_step``), never one step late;
* ``free_resources`` releases the slot (the C++ manager frees the blocks; a later request reuses them).

Checked against stand-ins of the upstream classes (tests/plugins/test_trtllm_contract.py, both layouts).
"""

from __future__ import annotations

import math
from dataclasses import replace

from .book import PageBook, reset_lengths


def _with_max_tokens(kv_cache_config, max_tokens: int):
    """``kv_cache_config`` with ``max_tokens`` set (pydantic ``model_copy`` or a plain attribute)."""
    if hasattr(kv_cache_config, "model_copy"):
        return kv_cache_config.model_copy(update={"max_tokens": max_tokens})
    kv_cache_config.max_tokens = max_tokens
    return kv_cache_config


def make_cache_manager_class(up, deployment, ops_factory):
    """``OscarKVCacheManager(up.KVCacheManager)`` for one deployment; ``ops_factory()`` gives the cache ops."""
    import torch

    from oscar_export.kernels.layout import PagedKV

    lay = deployment.layout

    class OscarKVCacheManager(up.KVCacheManager):
        is_oscar_cache = True

        def __init__(self, kv_cache_config, kv_cache_type, *, num_layers, num_kv_heads, head_dim, tokens_per_block,
                     max_seq_len, max_batch_size, mapping, **kwargs):
            heads = set(num_kv_heads) if isinstance(num_kv_heads, (list, tuple)) else {num_kv_heads}
            if tokens_per_block != lay.page_size:
                raise ValueError(f"tokens_per_block {tokens_per_block}: the OSCAR cache needs tokens_per_block = the "
                                 f"page size {lay.page_size} (kv_cache_config.tokens_per_block)")
            if num_layers != deployment.num_layers or heads != {lay.num_kv_heads} or head_dim != lay.head_dim:
                raise ValueError(f"model: {num_layers} layers x {sorted(heads)} KV heads x head_dim {head_dim}; the "
                                 f"OSCAR artifact: {deployment.num_layers} x {lay.num_kv_heads} x {lay.head_dim}")
            if getattr(mapping, "world_size", 1) != 1:
                raise NotImplementedError("the OSCAR cache serves one GPU (tensor/pipeline parallelism: world_size 1)")
            pages_per_seq = math.ceil(max_seq_len / lay.page_size)
            slots = max_batch_size
            kv_cache_config = _with_max_tokens(kv_cache_config, slots * pages_per_seq * lay.page_size)
            super().__init__(kv_cache_config, kv_cache_type, num_layers=1, num_kv_heads=lay.num_kv_heads,
                             head_dim=head_dim, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                             max_batch_size=max_batch_size, mapping=mapping, **kwargs)
            pool_pages, max_pages = int(self.get_max_resource_count()), int(self.max_blocks_per_seq)
            deployment.check_limits(slots, max_seq_len, max_pages, pool_pages)
            dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            self.book = PageBook(lay, slots, max_pages)
            rows = slots + 1  # + the scratch row (book.scratch)
            self.block_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=dev)
            self.layers = [replace(PagedKV.allocate(lay, rows, pool_pages, max_pages, dev, torch.bfloat16),
                                   block_table=self.block_table) for _ in range(deployment.num_layers)]
            # batch row -> state row, on the device (rows past the batch: the scratch row)
            self.step_slots = torch.full((rows,), self.book.scratch, dtype=torch.int32, device=dev)
            self.step_slots_host: list[int] = []
            self.dummy_ids: set[int] = set()
            self.ops = ops_factory()

        # ---- per step ----------------------------------------------------------------------------------------
        def _admit(self, req, context: bool) -> int:
            if req.py_request_id in self.dummy_ids:
                return self.book.scratch
            if not context:  # a generation request must already own a slot (KeyError names it otherwise)
                slot = self.book.slot_of(req.py_request_id)
            else:
                slot, new = self.book.admit(req.py_request_id, req.prompt_len + req.max_new_tokens)
                if new:
                    reset_lengths(self.layers, slot)
            self.book.set_row(slot, self.get_cache_indices(req), self.block_table)
            return slot

        def _write_step_slots(self, slots: list[int]) -> None:
            """Batch row ``i`` -> ``slots[i]``; every later row -> the scratch row (a stream-ordered H2D copy)."""
            full = list(slots) + [self.book.scratch] * (self.step_slots.shape[0] - len(slots))
            self.step_slots.copy_(torch.tensor(full, dtype=torch.int32))
            self.step_slots_host = list(slots)

        def prepare_resources(self, scheduled_batch):
            super().prepare_resources(scheduled_batch)
            slots = [self._admit(r, True) for r in scheduled_batch.context_requests]
            slots += [self._admit(r, False) for r in scheduled_batch.generation_requests]
            self._write_step_slots(slots)

        def add_dummy_requests(self, request_ids, *args, **kwargs):
            """Upstream's, remembering the ids: their rows go to the scratch row. ``step_slots`` is left alone:
            TensorRT-LLM makes its padding request inside the forward, after ``prepare_resources`` wrote the
            batch (rows past it already point at the scratch row); an eager warmup batch is mapped by the
            attention's check."""
            reqs = super().add_dummy_requests(request_ids, *args, **kwargs)
            self.dummy_ids.update(r.py_request_id for r in reqs)
            return reqs

        def free_resources(self, request, *args, **kwargs):
            rid = request.py_request_id
            self.dummy_ids.discard(rid)
            if rid in self.book.slots:
                self.book.release(self.book.slot_of(rid))
            return super().free_resources(request, *args, **kwargs)

        def slots_for(self, request_ids) -> list[int]:
            """State rows of a batch: the request's slot, the scratch row for a dummy request."""
            return [self.book.scratch if r in self.dummy_ids else self.book.slot_of(r) for r in request_ids]

    OscarKVCacheManager.__qualname__ = OscarKVCacheManager.__name__
    return OscarKVCacheManager


__all__ = ["make_cache_manager_class"]
