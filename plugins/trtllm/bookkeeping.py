"""SUPERSEDED by book.py + device-side demotion (kept only for tests/gpu/test_aot_gpu.py until it moves).

Host-side bookkeeping of the OSCAR cache inside a TensorRT-LLM executor, in plain Python (tested here).

TensorRT-LLM's PyTorch executor calls a resource manager once per scheduled batch: ``prepare_resources``
before the forward (room for the tokens about to be written) and ``update_resources`` after it (here:
demotion, i.e. the oldest ``P`` recent tokens of a sequence become one INT2 page). This file holds the
decisions, not the tensors: which pool pages a request owns, when each demotion is due, the block table
rows and lengths the kernels read, and the shape rules. ``module.py`` wraps it in TensorRT-LLM classes.

State of one sequence follows ``KVCacheLayout.split`` exactly: after ``T`` tokens it holds
``min(T, S0)`` sink tokens, ``pages_for(T)`` pages and the rest in *recent* (at most ``W + P``).

Order of events per step: ``prepare_resources`` admits requests; the forward writes the new tokens (a
prompt straight into sink / pages / recent: ``grow`` returns the pages the prompt fills); ``update_resources``
records them (``grow``) and, for each request that continues, ``reserve_next`` demotes when *recent* is
full, so the next forward always has a free recent slot and the stored state is always ``layout.split``
of the length (or one page further, after a reservation).

Not executed inside TensorRT-LLM (it cannot be installed here); tests/plugins/test_trtllm.py checks every
rule against the layout and the reference cache writer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oscar_export.kernels.layout import KVCacheLayout


class PoolExhausted(RuntimeError):
    """No free INT2 page is left for a demotion."""


@dataclass
class PagePool:
    """Free list of INT2 page ids ``0 .. num_pages - 1`` shared by all sequences of one executor.

    Pages are handed out lowest id first (deterministic: the same schedule gives the same block tables).
    """

    num_pages: int
    _free: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.num_pages <= 0:
            raise ValueError(f"PagePool.num_pages: expected > 0, got {self.num_pages}")
        self._free = list(range(self.num_pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise PoolExhausted(f"the INT2 page pool ({self.num_pages} pages) is full")
        return self._free.pop()

    def release(self, pages: list[int]) -> None:
        taken = set(range(self.num_pages)) - set(self._free)
        bad = [p for p in pages if p not in taken]
        if bad:
            raise ValueError(f"PagePool.release: pages {bad} are not allocated")
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)


@dataclass
class Sequence:
    """One request's cache bookkeeping: ``length`` tokens written, ``pages`` owned in order."""

    request_id: int
    slot: int
    length: int = 0
    pages: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Demotion:
    """Quantize the oldest ``P`` recent tokens of the sequence in batch ``slot`` into pool page ``page``."""

    request_id: int
    slot: int
    page: int


@dataclass
class OscarCacheBook:
    """All sequences of one executor over one layout (every layer shares the same book).

    Args:
        layout: the artifact's cache layout.
        max_batch: slots (rows of the block table).
        max_pages_per_seq: columns of the block table.
        pool_pages: INT2 pages in the pool (per layer; every layer has the same page ids).
    """

    layout: KVCacheLayout
    max_batch: int
    max_pages_per_seq: int
    pool_pages: int
    seqs: dict[int, Sequence] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_batch <= 0 or self.max_pages_per_seq <= 0:
            raise ValueError(f"max_batch and max_pages_per_seq must be > 0, got {self.max_batch}, {self.max_pages_per_seq}")
        self.pool = PagePool(self.pool_pages)

    # ---- requests ------------------------------------------------------------------------------------------
    def add(self, request_id: int) -> Sequence:
        if request_id in self.seqs:
            raise ValueError(f"request {request_id} is already in the cache")
        used = {s.slot for s in self.seqs.values()}
        free = [i for i in range(self.max_batch) if i not in used]
        if not free:
            raise PoolExhausted(f"all {self.max_batch} batch slots are in use")
        seq = Sequence(request_id, free[0])
        self.seqs[request_id] = seq
        return seq

    def free(self, request_id: int) -> None:
        seq = self.seqs.pop(request_id)
        self.pool.release(seq.pages)

    # ---- per step ------------------------------------------------------------------------------------------
    def max_length(self) -> int:
        """Longest sequence the block table can hold."""
        lay = self.layout
        return lay.sink + self.max_pages_per_seq * lay.page_size + lay.recent_capacity

    def can_grow(self, request_id: int, new_tokens: int) -> bool:
        """Whether ``new_tokens`` more tokens fit (block table columns and free pages)."""
        seq = self.seqs[request_id]
        need = self.layout.pages_for(seq.length + new_tokens) - len(seq.pages)
        return seq.length + new_tokens <= self.max_length() and need <= self.pool.free

    def grow(self, request_id: int, new_tokens: int) -> list[Demotion]:
        """Record ``new_tokens`` written to the request; return the demotions now due, oldest first.

        Prefill (many tokens) may produce several demotions at once: they are exactly the pages
        ``layout.split`` says the longer sequence holds.
        """
        if new_tokens < 0:
            raise ValueError(f"new_tokens: expected >= 0, got {new_tokens}")
        seq = self.seqs[request_id]
        target = seq.length + new_tokens
        if target > self.max_length():
            raise ValueError(
                f"request {request_id}: {target} tokens exceed the block table ({self.max_pages_per_seq} pages "
                f"-> at most {self.max_length()} tokens)"
            )
        due = self.layout.pages_for(target) - len(seq.pages)
        if due > self.pool.free:
            raise PoolExhausted(f"request {request_id} needs {due} pages, {self.pool.free} are free")
        out = []
        for _ in range(due):
            page = self.pool.allocate()
            seq.pages.append(page)
            out.append(Demotion(request_id, seq.slot, page))
        seq.length = target
        return out

    def reserve_next(self, request_id: int) -> Demotion | None:
        """Make room for the request's next token now (TensorRT-LLM's update step, after a forward).

        If appending one token would overflow *recent* (``W + P`` tokens), allocate the page the demotion
        fills and return it: the caller quantizes the oldest ``P`` recent tokens into it before the next
        forward writes. The following ``grow(request_id, 1)`` then finds the page already there.
        """
        seq = self.seqs[request_id]
        due = self.layout.pages_for(seq.length + 1) - len(seq.pages)
        if due <= 0:
            return None
        assert due == 1, (request_id, seq.length, seq.pages)
        if seq.length + 1 > self.max_length():
            raise ValueError(f"request {request_id}: the block table is full ({self.max_length()} tokens)")
        page = self.pool.allocate()
        seq.pages.append(page)
        return Demotion(request_id, seq.slot, page)

    # ---- what the kernels read ----------------------------------------------------------------------------
    def split(self, request_id: int) -> tuple[int, int, int]:
        """``(sink_len, num_pages, recent_len)`` of the request as stored (a page reserved for the next token
        already holds the oldest ``P`` recent tokens)."""
        seq = self.seqs[request_id]
        sink, pages, recent = self.layout.split(seq.length)
        extra = len(seq.pages) - pages  # 0, or 1 after reserve_next
        return sink, pages + extra, recent - extra * self.layout.page_size

    def tables(self, request_ids: list[int]) -> dict[str, list]:
        """Block table rows and lengths for a batch in ``request_ids`` order (int32 tensors on the host side).

        Returns ``block_table [B, max_pages]`` (unused entries 0), ``sink_len``, ``num_pages``, ``recent_len``
        ``[B]``, and ``max_pages`` = the widest row actually used (at least 1), which the decode launch reads.
        """
        rows, sink, npg, rec = [], [], [], []
        for rid in request_ids:
            s, n, r = self.split(rid)
            pages = self.seqs[rid].pages
            assert len(pages) == n, (rid, pages, n)
            rows.append(pages)
            sink.append(s)
            npg.append(n)
            rec.append(r)
        width = max([1] + [len(p) for p in rows])
        table = [p + [0] * (width - len(p)) for p in rows]
        return {"block_table": table, "sink_len": sink, "num_pages": npg, "recent_len": rec, "max_pages": width}

    def kv_bytes(self, request_ids: list[int] | None = None) -> int:
        """Cache bytes of the given requests in one layer (from the layout, never by hand)."""
        ids = list(self.seqs) if request_ids is None else request_ids
        return sum(self.layout.sequence_bytes(self.seqs[i].length) for i in ids)


def pool_pages_for(layout: KVCacheLayout, max_batch: int, max_seq_len: int) -> int:
    """Pool size that holds ``max_batch`` sequences of ``max_seq_len`` tokens."""
    return max(1, max_batch * layout.pages_for(max_seq_len))


def pages_per_seq_for(layout: KVCacheLayout, max_seq_len: int) -> int:
    return max(1, layout.pages_for(max_seq_len))


__all__ = ["Demotion", "OscarCacheBook", "PagePool", "PoolExhausted", "Sequence", "pages_per_seq_for", "pool_pages_for"]
