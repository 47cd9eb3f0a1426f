"""The OSCAR cache inside TensorRT-LLM: a subclass of its ``KVCacheManager`` (NOT EXECUTED in TensorRT-LLM).

The C++ block manager (``self.impl``) stays in charge of admission, scheduling, dummy requests and block
ids; with ``tokens_per_block = P`` each block id is also an INT2 page id: page ``i`` of a sequence is its C++
block ``i`` (a sequence of ``T`` tokens holds ``ceil(T / P)`` blocks, more than the ``layout.pages_for(T + 1)``
pages its next decode step may fill). Pages, lengths and the step protocol are the shared page book's
(``kernels/pages.py``, ``PageBook``): its rows are written with the C++ block ids (``PageBook.assign``), so the
book owns no free list here. The subclass

* builds the stock pool for a single layer and only as many blocks as ``max_batch_size`` full sequences need
  (``kv_cache_config.max_tokens``), so the BF16 pool TensorRT-LLM allocates shrinks by the layer count;
  UNTESTED in TensorRT-LLM: whether anything besides the attention backend reads the stock pool per layer;
* allocates one ``PagedKV`` per layer in that layer's layout (``deployment.layer_layouts``: 4-bit key pages
  where the artifact's ``key_bits`` say so; BF16 sink and recent ring, INT2 pools with one page per C++ block),
  all viewed through the book: :attr:`layers` with its committed lengths, :attr:`step_layers` with the step's,
  and :attr:`ops` the cache ops of each layer's layout (the bundle's ``_k4`` kernels for 4-bit-key layers; their
  AOT launch through the driver API is not yet run on a GPU: ``tests/gpu/test_trtllm_gpu.py``
  ``test_4bit_key_ops_aot_equal_jit``);
* keeps the one TensorRT-LLM-specific map: request id -> book slot (:attr:`slots`), plus one *scratch* slot
  that no request owns: batch rows of dummy requests (``add_dummy_requests``: CUDA-graph warmup, capture and
  batch padding) point there, and a step never writes it;
* in ``prepare_resources`` gives each request a slot (a new sequence: ``PageBook.reset``), copies its C++ block
  ids into the book's row and writes the batch's slots, in batch order, into the device buffer
  ``step_slots`` the attention reads. These device writes (and ``free_resources``') are issued on upstream's
  ``execution_stream``, after the last forward and before an event the next forward waits on
  (:meth:`device_writes`, ``streams.py``), so the forward -- on whichever stream it runs -- reads a new
  request's slot after its reset, and under the overlap executor loop (``prepare_resources(N+1)`` before
  ``update_resources(N)``) nothing the forward of step N reads changes under it;
* per forward, :meth:`begin_step` (first layer) and :meth:`commit_step` (last layer) run the book's step:
  every layer writes beyond the committed lengths, the commit adds each slot's tokens (``step_tokens``, device);
  a state row that takes no token is flagged :data:`STATUS_IDLE`, so no writer touches it;
* ``free_resources`` releases the slot (the C++ manager frees the blocks; a later request reuses them);
* at startup TensorRT-LLM builds the manager twice (``_torch/pyexecutor/_util.py`` ``KvCacheCreator``): once for
  the KV-cache estimation (dummy context requests of ``max_num_tokens``), then ``configure_kv_cache_capacity``
  measures the peak memory, adds the manager's ``get_kv_cache_stats().allocated_bytes`` back, sets
  ``max_gpu_total_bytes`` and ``max_tokens`` (over :meth:`get_cache_size_per_token`), and after ``shutdown()``
  builds it again. ``shutdown`` releases the OSCAR pools (anything still holding the estimation's manager holds
  no pool); ``get_cache_size_per_token`` is the OSCAR cache's bytes per token (INT2 pages of every layer plus the
  one-layer stock pool); ``get_kv_cache_stats`` counts the OSCAR pools as allocated KV cache, so the estimation
  does not take them for activations; a build whose memory cannot hold ``max_batch_size`` sequences of
  ``max_seq_len`` is refused with one line (:func:`check_budget`: ``max_gpu_total_bytes``, or ``max_tokens``
  where upstream passes ``is_estimating_kv_cache=False``);
* ``add_dummy_requests`` passes on upstream's ``None`` (no free block: no padding request);
* a NaN/Inf key or value in a decode step or a prompt: the step does not commit that slot, the slot stays flagged
  in every later step (its cache holds the tokens of the steps before), and the next ``prepare_resources`` whose
  pinned copy of the flags has landed (the next step in the plain loop, a step later under overlap) fails that
  request alone, as it fails one longer than ``max_seq_len`` or one that finds no free slot: an exception in
  ``prepare_resources`` would reach the executor's error path, which fails every active request
  (``py_executor.py`` ``_handle_errors`` without ``requests``). The request ends as that path ends each request
  it fails (``state = GENERATION_COMPLETE``) and the reason is logged; UNTESTED in TensorRT-LLM: what response
  the client then gets (the error text reaches only the server log).

Checked against stand-ins of the upstream classes (tests/plugins/test_trtllm_cache.py, both layouts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import PagedKV
from oscar_export.kernels.pages import STATUS_NONFINITE, PageBook

from .streams import DeviceStreams

logger = logging.getLogger(__name__)

#: step status bit (beside ``pages.STATUS_*``) of a state row that takes no token in the forward in flight.
STATUS_IDLE = 4


def refuse_unsupported(kv_cache_config, mapping, spec_config=None, layer_mask=None) -> None:
    """Raise ``NotImplementedError`` (one line naming the setting) for a configuration the OSCAR cache cannot serve,
    before upstream's ``KVCacheManager.__init__`` sees it (main's ``_create_kv_cache_manager`` passes speculative
    decoding's ``layer_mask``, which ``get_pp_layers`` asserts against ``num_layers``)."""
    if spec_config is not None or (layer_mask is not None and not all(layer_mask)):
        what = "a layer_mask" if spec_config is None else f"speculative decoding ({type(spec_config).__name__})"
        raise NotImplementedError(f"{what}: the OSCAR cache serves the target model's own layers only; serve without "
                                  "speculative_config")
    if getattr(kv_cache_config, "enable_block_reuse", False):
        raise NotImplementedError("kv_cache_config.enable_block_reuse: reused blocks would hold BF16 data the OSCAR "
                                  "cache never wrote; set it to false (deploy/extra_llm_api_options.yaml)")
    for name, what in (("pp_size", "pipeline"), ("tp_size", "tensor"), ("cp_size", "context")):
        if getattr(mapping, name, 1) != 1:
            raise NotImplementedError(f"{what} parallelism ({name} {getattr(mapping, name)}): the OSCAR cache serves "
                                      "one GPU")
    if getattr(mapping, "world_size", 1) != 1:
        raise NotImplementedError(f"world_size {mapping.world_size}: the OSCAR cache serves one GPU")


def check_budget(kv_cache_config, need: int, per_token: int, what: str, estimating) -> None:
    """Raise ``ValueError`` (one line) when the KV-cache memory cannot hold ``need`` tokens of OSCAR cache: in bytes
    wherever ``max_gpu_total_bytes`` is set (``configure_kv_cache_capacity`` sets it after the estimation; every
    build allocates ``need`` tokens' pools), in tokens where upstream passes ``is_estimating_kv_cache=False``
    (the estimation's own ``max_tokens`` is the dummy requests' tokens, not a budget)."""
    need_bytes, budget_bytes = need * per_token, getattr(kv_cache_config, "max_gpu_total_bytes", None) or 0
    if budget_bytes and need_bytes > budget_bytes:  # 0: not set; below 0: the estimation found no memory left
        held = f"{budget_bytes} bytes (kv_cache_config.max_gpu_total_bytes / free_gpu_memory_fraction)"
    elif estimating is False and kv_cache_config.max_tokens is not None and need > kv_cache_config.max_tokens:
        held = f"{kv_cache_config.max_tokens} tokens (kv_cache_config.max_tokens / free_gpu_memory_fraction)"
    else:
        return
    raise ValueError(f"{what} needs {need} tokens of OSCAR cache ({need_bytes} bytes); the KV cache memory holds "
                     f"{held}: lower max_batch_size or max_seq_len")


class KvCacheStatsWithPools:
    """Upstream's ``KvCacheStats`` with ``extra`` bytes added to ``allocated_bytes`` (every other field read
    through)."""

    def __init__(self, stats, extra: int) -> None:
        self._stats = stats
        self.allocated_bytes = int(stats.allocated_bytes) + int(extra)

    def __getattr__(self, name):
        return getattr(self._stats, name)


def _with_max_tokens(kv_cache_config, max_tokens: int):
    """``kv_cache_config`` with ``max_tokens`` set (pydantic ``model_copy`` or a plain attribute)."""
    if hasattr(kv_cache_config, "model_copy"):
        return kv_cache_config.model_copy(update={"max_tokens": max_tokens})
    kv_cache_config.max_tokens = max_tokens
    return kv_cache_config


class OscarCacheMixin:
    """The OSCAR cache's half of ``OscarKVCacheManager`` (see the module doc); :func:`make_cache_manager_class` puts
    it before upstream's ``KVCacheManager`` (``super()`` is upstream's) and binds the deployment."""

    is_oscar_cache = True
    deployment = None  #: the ``OscarDeployment`` (class attribute, bound by make_cache_manager_class)
    request_states = None  #: upstream's ``LlmRequestState``

    @staticmethod
    def ops_factory(layout):  # bound by make_cache_manager_class
        raise NotImplementedError

    def __init__(self, kv_cache_config, kv_cache_type, *, num_layers, num_kv_heads, head_dim, tokens_per_block,
                 max_seq_len, max_batch_size, mapping, **kwargs):
        lay = self.deployment.layout
        self._check_model(num_layers, num_kv_heads, head_dim, tokens_per_block)
        refuse_unsupported(kv_cache_config, mapping, kwargs.get("spec_config"), kwargs.get("layer_mask"))
        kwargs.pop("layer_mask", None)  # every layer (refused otherwise); the stock pool has one
        pages_per_seq = math.ceil(max_seq_len / lay.page_size)
        slots = max_batch_size
        need = slots * pages_per_seq * lay.page_size
        check_budget(kv_cache_config, need, self.get_cache_size_per_token(), f"max_batch_size {slots} x "
                     f"max_seq_len {max_seq_len}", kwargs.get("is_estimating_kv_cache"))
        kv_cache_config = _with_max_tokens(kv_cache_config, need)
        super().__init__(kv_cache_config, kv_cache_type, num_layers=1, num_kv_heads=lay.num_kv_heads,
                         head_dim=head_dim, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                         max_batch_size=max_batch_size, mapping=mapping, **kwargs)
        #: where the device writes of admission go (streams.py): upstream's execution stream, when it passes one
        self.write_stream = kwargs.get("execution_stream")
        self.streams = DeviceStreams()
        self.admitted = self.forward_done = None  # events: after admission's writes / after the last forward
        pool_pages = int(self.get_max_resource_count())
        self.deployment.check_limits(slots, max_seq_len, int(self.max_blocks_per_seq), pool_pages)
        self._allocate(slots, max_seq_len, pool_pages)

    def _check_model(self, num_layers, num_kv_heads, head_dim, tokens_per_block) -> None:
        """Raise ``ValueError`` (one line) unless the model's attention shape and the block size are the artifact's."""
        deployment, lay = self.deployment, self.deployment.layout
        heads = set(num_kv_heads) if isinstance(num_kv_heads, (list, tuple)) else {num_kv_heads}
        if tokens_per_block != lay.page_size:
            raise ValueError(f"tokens_per_block {tokens_per_block}: the OSCAR cache needs tokens_per_block = the "
                             f"page size {lay.page_size} (kv_cache_config.tokens_per_block)")
        if num_layers != deployment.num_layers or heads != {lay.num_kv_heads} or head_dim != lay.head_dim:
            raise ValueError(f"model: {num_layers} layers x {sorted(heads)} KV heads x head_dim {head_dim}; the "
                             f"OSCAR artifact: {deployment.num_layers} x {lay.num_kv_heads} x {lay.head_dim}")

    def _allocate(self, slots: int, max_seq_len: int, pool_pages: int) -> None:
        """The page book, the OSCAR pools of every layer, the step's device buffers and the host maps."""
        layouts = self.deployment.layer_layouts
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        #: the request slots and the scratch slot (the last)
        self.book = PageBook(self.deployment.layout, slots + 1, max_seq_len, dev)
        self.book.block_table.zero_()  # a host-managed pool: rows are C++ block ids (PageBook.assign)
        self.scratch = slots
        bufs = [PagedKV.allocate(layer_lay, slots + 1, pool_pages, self.book.max_pages, dev, torch.bfloat16)
                for layer_lay in layouts]
        self.layers = [self.book.state_view(s, self.book.committed) for s in bufs]
        self.step_layers = [self.book.state_view(s, self.book.in_step) for s in bufs]
        held = [getattr(st, f.name) for st in self.layers + self.step_layers for f in dataclasses.fields(st)]
        #: device bytes of the OSCAR pools, windows and page book (get_kv_cache_stats counts them)
        self.pool_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                               for t in held + self.book.tensors()}.values())
        # batch row -> state row, on the device (rows past the batch: the scratch slot)
        self.step_slots = torch.full((slots + 1,), self.scratch, dtype=torch.int32, device=dev)
        self.step_slots_host: list[int] = []
        #: tokens each state row takes in the forward in flight (device; begin_step)
        self.step_tokens = torch.zeros(slots + 1, dtype=torch.int32, device=dev)
        #: the forward's context rows ``(slot, start, n)`` and their write plan (begin_step; every layer's)
        self.context_rows: list[tuple[int, int, int]] = []
        self.context_plan = None
        self.slots: dict[int, int] = {}  # request id -> slot
        self.rows: dict[int, list[int]] = {}  # slot -> C++ block ids as copied to the book
        self.dummy_ids: set[int] = set()
        #: request id -> why the cache failed it (until free_resources)
        self.failed: dict[int, str] = {}
        # non-finite tokens: the request id owning each state row (-1: none) and, per row, the id of the last
        # request a NaN/Inf token reached (device, set at commit; sticky, so the row takes nothing more) with
        # its pinned host copy, read by prepare_resources (a step or two late under the overlap loop)
        self.slot_rid = torch.full((slots + 1,), -1, dtype=torch.int64, device=dev)
        self.bad_rid = torch.full_like(self.slot_rid, -1)
        self.bad_rid_host = torch.full((slots + 1,), -1, dtype=torch.int64,
                                       pin_memory=dev.type == "cuda")
        by_layout = {layer_lay: self.ops_factory(layer_lay) for layer_lay in dict.fromkeys(layouts)}
        #: the cache ops of each layer (one object per distinct layout)
        self.ops = [by_layout[layer_lay] for layer_lay in layouts]

    @classmethod
    def get_cache_size_per_token(cls, model_config=None, mapping=None, **kwargs) -> int:
        """Bytes per cached token: the INT2 pages (codes and params) of every layer plus the one-layer BF16
        stock pool (the BF16 sink and recent ring are a fixed cost per sequence slot, not per token)."""
        pages, lay = 0, cls.deployment.layout
        for layer_lay in cls.deployment.layer_layouts:
            pages += math.prod(layer_lay.key_codes_shape(1)) + 2 * math.prod(layer_lay.key_params_shape(1))
            pages += math.prod(layer_lay.value_codes_shape(1)) + 2 * math.prod(layer_lay.value_params_shape(1))
        return math.ceil(pages / lay.page_size) + 2 * 2 * lay.num_kv_heads * lay.head_dim

    def get_kv_cache_stats(self):
        """Upstream's, with :attr:`pool_bytes` added to ``allocated_bytes``: the KV-cache estimation
        (``configure_kv_cache_capacity``) adds the manager's ``allocated_bytes`` back to the peak memory it
        measured, so pools left out would count as activations and shrink the cache by their size."""
        return KvCacheStatsWithPools(super().get_kv_cache_stats(), self.pool_bytes)

    def shutdown(self):
        """Release the OSCAR pools, then upstream's (teardown after the KV-cache estimation, and at exit)."""
        self.layers, self.step_layers, self.ops = [], [], []
        self.book = self.step_slots = self.step_tokens = self.context_plan = None
        self.slot_rid = self.bad_rid = self.bad_rid_host = None
        self.slots, self.rows, self.dummy_ids, self.failed = {}, {}, set(), {}
        return super().shutdown()

    # ---- slots -------------------------------------------------------------------------------------------
    def slot_of(self, request_id: int) -> int:
        if request_id not in self.slots:
            raise KeyError(f"request {request_id} has no OSCAR cache slot (was it admitted by prepare_resources?)")
        return self.slots[request_id]

    def _admit(self, req, context: bool) -> int:
        rid = req.py_request_id
        if rid in self.failed:
            self._fail(req, self.failed[rid])
        if rid in self.dummy_ids or rid in self.failed:
            return self.scratch
        if rid not in self.slots:
            if not context:  # a generation request must already own a slot (KeyError names it)
                self.slot_of(rid)
            free = [s for s in range(self.scratch) if s not in self.slots.values()]
            need = req.prompt_len + req.max_new_tokens
            if need > self.book.max_length:
                self._fail(req, f"request {rid}: prompt + max_new_tokens = {need} tokens; the OSCAR cache "
                                f"reserved {self.book.max_length} per sequence (max_seq_len)")
            elif not free:
                self._fail(req, f"request {rid}: all {self.scratch} OSCAR cache slots hold live sequences")
            if rid in self.failed:
                return self.scratch
            self.slots[rid] = free[0]
            self.rows.pop(free[0], None)
            self.book.reset(free[0])
            self.slot_rid.narrow(0, free[0], 1).fill_(rid)
        slot = self.slots[rid]
        self._set_row(slot, list(self.get_cache_indices(req))[: self.book.max_pages])
        return slot

    def _to_device(self, values: list[int]):
        """``values`` as an int32 device tensor, copied from pinned memory without a host synchronisation (a
        pageable copy would synchronise the current stream every step); the copy is stream-ordered like the
        rest of :meth:`device_writes`."""
        host = torch.tensor(values, dtype=torch.int32)
        if self.book.device.type != "cuda":
            return host
        return host.pin_memory().to(self.book.device, non_blocking=True)

    def _set_row(self, slot: int, ids: list[int]) -> None:
        """Copy the C++ block ids of ``slot`` into the book's row when they changed (a stream-ordered copy)."""
        old = self.rows.get(slot, [])
        if old == ids:
            return
        if old != ids[: len(old)]:
            raise RuntimeError(f"slot {slot}: the C++ block ids changed under live pages ({old} -> {ids})")
        self.book.assign(slot, self._to_device(ids))
        self.rows[slot] = ids

    def _write_step_slots(self, slots: list[int]) -> None:
        """Batch row ``i`` -> ``slots[i]``; every later row -> the scratch slot (a stream-ordered H2D copy)."""
        full = list(slots) + [self.scratch] * (self.step_slots.shape[0] - len(slots))
        self.step_slots.copy_(self._to_device(full))
        self.step_slots_host = list(slots)

    def slots_for(self, request_ids) -> list[int]:
        """State rows of a batch: the request's slot, the scratch slot for a dummy or failed request."""
        return [self.scratch if r in self.dummy_ids or r in self.failed else self.slot_of(r) for r in request_ids]

    def _fail(self, req, reason: str) -> None:
        """Fail ``req`` alone: its rows go to the scratch slot (computed, never stored), its slot is released,
        and it ends as upstream's executor ends a request it fails (``state = GENERATION_COMPLETE``), with
        ``reason`` logged once and kept in :attr:`failed` until ``free_resources``."""
        rid = req.py_request_id
        if rid not in self.failed:
            logger.error("OSCAR cache: %s; this request fails, the others go on", reason)
        self.failed[rid] = reason
        req.state = self.request_states.GENERATION_COMPLETE
        slot = self.slots.pop(rid, None)
        if slot is not None:
            self.rows.pop(slot, None)
            self.slot_rid.narrow(0, slot, 1).fill_(-1)

    # ---- the executor's calls ------------------------------------------------------------------------------
    def find_nonfinite(self) -> None:
        """Mark every live request a NaN/Inf decode token reached as failed (host; reads the pinned copy the
        last finished step left, never waits for the device); ``_admit`` fails it when it is next scheduled."""
        bad = self.bad_rid_host.tolist()
        for rid in sorted(rid for rid, slot in self.slots.items() if bad[slot] == rid):
            self.failed[rid] = (f"request {rid}: a NaN/Inf key or value reached the OSCAR cache (its cache holds "
                                "the tokens of the steps before)")

    @contextlib.contextmanager
    def device_writes(self):
        """The block's device writes go on :attr:`write_stream`, after the last forward, before
        :attr:`admitted` (``streams.py``)."""
        with self.streams.using(self.write_stream):
            self.streams.wait(self.forward_done)
            yield
            self.admitted = self.streams.record()

    def prepare_resources(self, scheduled_batch):
        """Upstream's, then each request's slot and block-table row and the batch's slot list (device writes:
        :meth:`device_writes`). A request the cache cannot serve -- longer than ``max_seq_len``, no free slot, a
        NaN/Inf token in its cache -- fails alone (:meth:`_fail`); nothing here raises for one request."""
        self.find_nonfinite()
        super().prepare_resources(scheduled_batch)
        with self.device_writes():
            slots = [self._admit(r, True) for r in scheduled_batch.context_requests]
            slots += [self._admit(r, False) for r in scheduled_batch.generation_requests]
            self._write_step_slots(slots)

    def add_dummy_requests(self, request_ids, *args, **kwargs):
        """Upstream's (``None`` when no block is free), remembering the ids: their rows go to the scratch
        slot. ``step_slots`` is left alone: TensorRT-LLM makes its padding request inside the forward, after
        ``prepare_resources`` wrote the batch (rows past it already point at the scratch slot); an eager warmup
        batch is mapped by the attention's check."""
        reqs = super().add_dummy_requests(request_ids, *args, **kwargs)
        if reqs is not None:  # None: no free block (upstream then pads nothing)
            self.dummy_ids.update(r.py_request_id for r in reqs)
        return reqs

    def free_resources(self, request, *args, **kwargs):
        rid = request.py_request_id
        self.dummy_ids.discard(rid)
        self.failed.pop(rid, None)
        slot = self.slots.pop(rid, None)
        if slot is not None:
            self.rows.pop(slot, None)
            with self.device_writes():
                self.slot_rid.narrow(0, slot, 1).fill_(-1)
        return super().free_resources(request, *args, **kwargs)

    # ---- one forward: the page book's step -------------------------------------------------------------------
    def begin_step(self, context_rows: list[tuple[int, int, int]], gen_rows) -> None:
        """Before the first layer: ``context_rows`` ``(slot, start, n)`` of the context rows (host, eager steps
        only; planned once for every layer: :attr:`context_plan`), ``gen_rows`` the device slots of the
        generation rows (one token each). Device ops only for the generation rows, so a captured decode step
        replays with the current batch's slots."""
        tok = self.step_tokens
        tok.zero_()
        tok.index_fill_(0, gen_rows, 1)
        self.context_rows = list(context_rows)
        self.context_plan = None
        if context_rows:
            rows = [(None if slot == self.scratch else slot, start, n) for slot, start, n in context_rows]
            self.context_plan = reference.plan_writes(self.deployment.layout, rows, self.book.max_pages,
                                                      self.book.device)
            tok.index_put_((self._plan_slots(),), self.context_plan.row_t.to(tok.dtype), accumulate=True)
        tok.narrow(0, self.scratch, 1).zero_()  # padding rows: computed, never stored (no H2D copy: capturable)
        self.book.begin(tok)
        self.book.flag((tok == 0).to(torch.int32) * STATUS_IDLE)
        poisoned = (self.bad_rid >= 0) & (self.bad_rid == self.slot_rid)
        self.book.flag(poisoned.to(torch.int32) * STATUS_NONFINITE)

    def _plan_slots(self):
        """The state row of each row of :attr:`context_plan` (a row that is not stored: the scratch slot)."""
        row_b = self.context_plan.row_b
        return torch.where(row_b >= 0, row_b, self.scratch)

    def flag_context_rows(self, nonfinite) -> None:
        """Flag the context rows whose ``nonfinite [rows]`` (bool, device) is set: the step does not commit them
        and :meth:`commit_step` records their requests as failed (no host read)."""
        bits = torch.zeros_like(self.book.status)
        bits.index_put_((self._plan_slots(),), nonfinite.to(bits.dtype) * STATUS_NONFINITE, accumulate=True)
        bits.narrow(0, self.scratch, 1).zero_()
        self.book.flag(bits)

    def commit_step(self) -> None:
        """After the last layer: every slot whose status is 0 now holds its ``step_tokens`` more."""
        self.book.commit(self.step_tokens)
        nonfinite = (self.book.status & STATUS_NONFINITE) != 0
        self.bad_rid.copy_(torch.where(nonfinite, self.slot_rid, self.bad_rid))
        self.bad_rid_host.copy_(self.bad_rid, non_blocking=True)


def make_cache_manager_class(up, deployment, ops_factory):
    """``OscarKVCacheManager(up.KVCacheManager)`` for one deployment; ``ops_factory(layout)`` gives the cache ops
    of one layer layout."""
    return type("OscarKVCacheManager", (OscarCacheMixin, up.KVCacheManager), {
        "deployment": deployment, "ops_factory": staticmethod(ops_factory),
        "request_states": getattr(up, "LlmRequestState", None), "__module__": __name__})

__all__ = [
    "STATUS_IDLE", "KvCacheStatsWithPools", "OscarCacheMixin", "check_budget", "make_cache_manager_class",
    "refuse_unsupported",
]
