"""The page/sequence book of the TensorRT-LLM host: which batch slot a request owns, its block-table row,
its device lengths, and the one rule for which rows a decode step may touch.

TensorRT-LLM's C++ ``KVCacheManager`` already allocates blocks of ``tokens_per_block`` tokens per sequence.
With ``tokens_per_block = P`` its block ids serve as INT2 page ids: page ``i`` of a sequence's history is
its C++ block ``i`` (a sequence of ``T`` tokens holds ``ceil(T / P)`` blocks, always more than the
``layout.pages_for(T)`` pages it has demoted, so the page a demotion fills is named before the kernel needs
it). The book therefore owns no free list; it maps request ids to slots (rows of the per-layer
``PagedKV`` tensors) and copies the C++ block ids into the shared device block table.

This is a stop-gap with the interface the shared book will have (``kernels/pages.py``, being written by the
lead): ``reserve(slot, max_tokens)``, ``release(slot)``, the block-table row, the device lengths. Every
host-side decision about *where* a token goes is in :meth:`PageBook.expected_split` (``layout.split``) and
:func:`mask_inactive` / :func:`restore_inactive` (the slot arithmetic of a decode step), so a ring-buffer
recent window changes one place.

Pure torch (CPU or CUDA), no TensorRT-LLM: tested in tests/plugins/test_trtllm_contract.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SlotsExhausted(RuntimeError):
    """Every batch slot holds a live sequence."""


@dataclass
class PageBook:
    """Slots and block-table rows of one executor (every layer shares them; lengths are per layer).

    Args:
        layout: the artifact's cache layout (``P`` = TensorRT-LLM's ``tokens_per_block``).
        num_slots: slots requests can hold (the max batch size). The per-layer state has one more row,
            :attr:`scratch`: batch rows no request owns (dummy requests: CUDA-graph warmup, capture, padding)
            point there, and it never stores a token (the attention masks it, :func:`mask_inactive`).
        max_pages: block-table columns (TensorRT-LLM's ``max_blocks_per_seq``).
    """

    layout: object
    num_slots: int
    max_pages: int
    slots: dict[int, int] = field(default_factory=dict)  # request id -> slot
    limits: dict[int, int] = field(default_factory=dict)  # slot -> max tokens reserved
    rows: dict[int, list[int]] = field(default_factory=dict)  # slot -> block ids as copied to the device

    def __post_init__(self) -> None:
        if self.num_slots <= 0 or self.max_pages <= 0:
            raise ValueError(f"PageBook: num_slots and max_pages must be > 0, got {self.num_slots}, {self.max_pages}")

    @property
    def scratch(self) -> int:
        """The state row of batch rows that belong to no request."""
        return self.num_slots

    # ---- the shared-book interface ---------------------------------------------------------------------------
    def max_tokens(self) -> int:
        """Longest sequence a block-table row can hold."""
        lay = self.layout
        return lay.sink + self.max_pages * lay.page_size + lay.recent_capacity

    def reserve(self, slot: int, max_tokens: int) -> None:
        """Claim ``slot`` for a sequence of at most ``max_tokens`` tokens (one clear error when it cannot fit)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"reserve: slot {slot} is outside 0..{self.num_slots - 1}")
        if slot in self.limits:
            raise ValueError(f"reserve: slot {slot} is already reserved")
        if max_tokens > self.max_tokens():
            raise ValueError(
                f"a sequence of {max_tokens} tokens needs {self.layout.pages_for(max_tokens)} INT2 pages; the block "
                f"table holds {self.max_pages} per sequence (at most {self.max_tokens()} tokens): lower max_seq_len"
            )
        self.limits[slot] = max_tokens

    def release(self, slot: int) -> None:
        self.limits.pop(slot)
        self.rows.pop(slot, None)
        for rid in [r for r, s in self.slots.items() if s == slot]:
            del self.slots[rid]

    def row(self, slot: int) -> list[int]:
        """The block-table row of ``slot`` as last written to the device."""
        return self.rows.get(slot, [])

    # ---- requests ---------------------------------------------------------------------------------------------
    def slot_of(self, request_id: int) -> int:
        if request_id not in self.slots:
            raise KeyError(f"request {request_id} has no OSCAR cache slot (was it admitted by prepare_resources?)")
        return self.slots[request_id]

    def admit(self, request_id: int, max_tokens: int) -> tuple[int, bool]:
        """``(slot, new)``: the request's slot, reserving the lowest free one on first sight."""
        if request_id in self.slots:
            return self.slots[request_id], False
        free = [s for s in range(self.num_slots) if s not in self.limits]
        if not free:
            raise SlotsExhausted(f"all {self.num_slots} OSCAR cache slots hold live sequences")
        self.reserve(free[0], max_tokens)
        self.slots[request_id] = free[0]
        return free[0], True

    def set_row(self, slot: int, block_ids: list[int], block_table) -> bool:
        """Copy ``block_ids`` (the C++ manager's, in order) into the device ``block_table`` row if they changed."""
        ids = list(block_ids)[: self.max_pages]
        if self.rows.get(slot) == ids:
            return False
        old = self.rows.get(slot, [])
        if old != ids[: len(old)]:
            raise RuntimeError(f"slot {slot}: the C++ block ids changed under live pages ({old} -> {ids})")
        import torch

        block_table[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.rows[slot] = ids
        return True

    def expected_split(self, tokens: int) -> tuple[int, int, int]:
        """``(sink_len, num_pages, recent_len)`` of a sequence of ``tokens`` tokens as stored (``layout.split``)."""
        return self.layout.split(tokens)


def reset_lengths(states, slot: int, split: tuple[int, int, int] = (0, 0, 0)) -> None:
    """Set the device lengths of ``slot`` in every layer (a new sequence: all zero)."""
    for st in states:
        st.sink_len[slot], st.num_pages[slot], st.recent_len[slot] = split


def mask_inactive(state, active):
    """Before a batched decode step over every slot: make the slots that take no token this step harmless.

    The decode-step kernels run over all rows (fixed shapes: CUDA-graph capturable). For an inactive row the
    lengths are set to ``(S0, 0, 0)``: no demotion is due and the appended token lands in recent slot 0, which
    :func:`restore_inactive` puts back with the lengths. Returns what restore needs. Device ops only.
    """
    import torch

    saved = (state.sink_len.clone(), state.num_pages.clone(), state.recent_len.clone(),
             state.recent_k[:, :, 0].clone(), state.recent_v[:, :, 0].clone())
    s0 = torch.full_like(state.sink_len, int(state.sink_k.shape[2]))
    state.sink_len.copy_(torch.where(active, state.sink_len, s0))
    state.num_pages.copy_(torch.where(active, state.num_pages, torch.zeros_like(state.num_pages)))
    state.recent_len.copy_(torch.where(active, state.recent_len, torch.zeros_like(state.recent_len)))
    return saved


def restore_inactive(state, active, saved) -> None:
    """Undo :func:`mask_inactive` on the inactive rows (device ops only)."""
    import torch

    sl, npg, rl, r0k, r0v = saved
    state.sink_len.copy_(torch.where(active, state.sink_len, sl))
    state.num_pages.copy_(torch.where(active, state.num_pages, npg))
    state.recent_len.copy_(torch.where(active, state.recent_len, rl))
    a = active[:, None, None]
    state.recent_k[:, :, 0] = torch.where(a, state.recent_k[:, :, 0], r0k)
    state.recent_v[:, :, 0] = torch.where(a, state.recent_v[:, :, 0], r0v)


__all__ = ["PageBook", "SlotsExhausted", "mask_inactive", "reset_lengths", "restore_inactive"]
