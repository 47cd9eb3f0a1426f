"""The page pool and the per-sequence book of one cache, on the device: the one place page bookkeeping lives.

A cache holds ``B`` sequence *slots*. Each slot owns ``max_pages = pages_for(max_length)`` INT2 pages of
the pool, reserved when the book is made (``block_table[b] = b * max_pages + [0, max_pages)``), so no step
ever allocates, and a finished sequence's slot is reused by resetting its length. A host that manages
pages itself (TensorRT-LLM's block manager) writes its own page ids into ``block_table`` rows instead
(:meth:`PageBook.assign`).

Lengths live on the device, ``[B]`` int32:

* ``seq_len``: the committed tokens of each slot. Everything the cache stores beyond it is invisible.
* ``sink_len, num_pages, recent_len``: ``layout.split(seq_len)``, what readers between steps see
  (:attr:`committed`).
* ``step_sink_len, step_num_pages, step_recent_len``: ``layout.split(seq_len + T)`` for the step in flight,
  what its attention reads (:attr:`in_step`).
* ``status``: per slot, the reasons the step in flight will not be committed (bit flags, below).

A step is :meth:`begin` (status cleared, step lengths computed), the writes of every layer (each a no-op
for a flagged slot, all of them into slots and pages the committed lengths do not reach, ``layout.py``),
then :meth:`commit`: ``seq_len += T`` where ``status == 0``. All of it is device arithmetic on static
buffers: no host read, no allocation, capturable in one CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .layout import KVCacheLayout, PagedKV, split_length

#: status bits of a step (``PageBook.status``): the token had a NaN/Inf key or value in some layer ...
STATUS_NONFINITE = 1
#: ... or would pass the slot's ``max_length``.
STATUS_FULL = 2


@dataclass
class Lengths:
    """``[B]`` int32 sink, page and recent counts (the three length fields of a ``PagedKV``)."""

    sink_len: torch.Tensor
    num_pages: torch.Tensor
    recent_len: torch.Tensor


class PageBook:
    """Pages reserved per slot, and the device-side lengths of ``batch`` sequences (see the module doc).

    Args:
        layout: the cache layout (shared by every layer).
        batch: B sequence slots.
        max_length: most tokens one slot may hold.
        device: where the book lives.
    """

    def __init__(self, layout: KVCacheLayout, batch: int, max_length: int, device: torch.device | str) -> None:
        if batch <= 0 or max_length <= 0:
            raise ValueError(f"batch and max_length: expected > 0, got {batch}, {max_length}")
        self.layout = layout
        self.batch = batch
        self.max_length = max_length
        self.max_pages = max(1, layout.pages_for(max_length))
        self.num_pool_pages = batch * self.max_pages
        z = lambda: torch.zeros(batch, dtype=torch.int32, device=device)  # noqa: E731
        self.block_table = torch.arange(self.num_pool_pages, dtype=torch.int32, device=device).view(batch, -1)
        self.seq_len = z()
        self.committed = Lengths(z(), z(), z())
        self.in_step = Lengths(z(), z(), z())
        self.status = z()
        self.device = self.seq_len.device

    def tensors(self) -> list[torch.Tensor]:
        """Every device buffer of the book (to mark as static addresses for CUDA graphs)."""
        c, s = self.committed, self.in_step
        return [self.block_table, self.seq_len, self.status, c.sink_len, c.num_pages, c.recent_len,
                s.sink_len, s.num_pages, s.recent_len]

    # ---- a step -------------------------------------------------------------------------------------------
    def begin(self, new_tokens: torch.Tensor | int) -> None:
        """Start a step that appends ``new_tokens`` (int, or ``[B]`` int32 per slot) to every slot."""
        self.status.zero_()
        grow = self.seq_len + new_tokens
        self.status.bitwise_or_((grow > self.max_length).to(torch.int32) * STATUS_FULL)
        _write_split(self.layout, grow, self.in_step)

    def flag(self, bits: torch.Tensor) -> None:
        """OR ``bits [B]`` int32 into the step's status (a writer found a reason not to commit)."""
        self.status.bitwise_or_(bits)

    def commit(self, new_tokens: torch.Tensor | int) -> None:
        """End the step: slots whose status is 0 now hold their ``new_tokens`` more."""
        self.seq_len.add_((self.status == 0).to(torch.int32) * new_tokens)
        _write_split(self.layout, self.seq_len, self.committed)

    # ---- slots --------------------------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """Forget slot ``slot`` (its pages stay reserved for the next sequence in it)."""
        self.check_slot(slot)
        self.seq_len[slot] = 0
        _write_split(self.layout, self.seq_len, self.committed)

    def reset_all(self) -> None:
        self.seq_len.zero_()
        _write_split(self.layout, self.seq_len, self.committed)

    def assign(self, slot: int, page_ids: torch.Tensor) -> None:
        """Hand slot ``slot`` the pool pages ``page_ids [n <= max_pages]`` (a host-managed pool)."""
        self.check_slot(slot)
        if page_ids.dim() != 1 or page_ids.numel() > self.max_pages:
            raise ValueError(f"page_ids: expected [<= {self.max_pages}], got {list(page_ids.shape)}")
        self.block_table[slot, : page_ids.numel()] = page_ids.to(self.block_table)

    def check_slot(self, slot: int) -> None:
        if type(slot) is bool or not isinstance(slot, int) or not 0 <= slot < self.batch:  # True is no slot
            raise IndexError(f"sequence slot: expected an int in 0..{self.batch - 1}, got {slot!r}")

    # ---- views --------------------------------------------------------------------------------------------
    def state_view(self, state: PagedKV, lengths: Lengths) -> PagedKV:
        """``state`` with this book's block table and the given lengths (a view, no copy)."""
        return replace(state, block_table=self.block_table, sink_len=lengths.sink_len,
                       num_pages=lengths.num_pages, recent_len=lengths.recent_len)


def _write_split(layout: KVCacheLayout, length: torch.Tensor, out: Lengths) -> None:
    torch.ops.oscar.write_split(length, out.sink_len, out.num_pages, out.recent_len, layout.sink,
                                layout.recent_capacity, layout.page_size)


@torch.library.custom_op("oscar::write_split", mutates_args=("sink_len", "num_pages", "recent_len"))
def _write_split_op(length: torch.Tensor, sink_len: torch.Tensor, num_pages: torch.Tensor, recent_len: torch.Tensor,
                    sink: int, recent_capacity: int, page_size: int) -> None:
    """``layout.split(length)`` into the three length buffers: one opaque op in a compiled step. As plain tensor
    ops, Inductor recomputed the split from ``seq_len`` in a small kernel of its own for every attention launch that
    reads the step's lengths (five a layer), and its fusion pass compared those kernels pairwise across the layers
    (a CPU proxy, 16 layers: fusion 9.2 s, BF16 ``StaticCache``'s 4.1 s)."""
    for buf, value in zip((sink_len, num_pages, recent_len), split_length(length, sink, recent_capacity, page_size)):
        buf.copy_(value)


__all__ = ["STATUS_FULL", "STATUS_NONFINITE", "Lengths", "PageBook"]
