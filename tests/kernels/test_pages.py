"""The page book (kernels/pages.py): pages reserved per slot, the step's lengths, the commit that skips flagged
slots, slot reset and host-assigned pages, and its refusals. The decode step that writes through it:
test_decode_step.py; the reference's host loop over it: test_reference.py."""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout, PagedKV, RowFormat
from oscar_export.kernels.pages import STATUS_FULL, STATUS_NONFINITE, PageBook

LAYOUT = KVCacheLayout(2, 64, RowFormat(64, 64), RowFormat(64, 64), sink=16, window=16, page_size=16)


def _lengths(lengths) -> list[list[int]]:
    return [lengths.sink_len.tolist(), lengths.num_pages.tolist(), lengths.recent_len.tolist()]


def _split(seq_len: list[int]) -> list[list[int]]:
    return [list(x) for x in zip(*(LAYOUT.split(n) for n in seq_len))]


def test_each_slot_owns_its_pages():
    book = PageBook(LAYOUT, 3, 200, "cpu")
    assert book.max_pages == LAYOUT.pages_for(200) and book.max_pages > 1
    assert book.num_pool_pages == 3 * book.max_pages
    assert book.block_table.dtype == torch.int32 and book.block_table.shape == (3, book.max_pages)
    assert book.block_table.flatten().tolist() == list(range(book.num_pool_pages))
    assert len(book.tensors()) == 9 and all(t.device.type == "cpu" for t in book.tensors())


def test_a_step_commits_the_slots_without_a_status():
    book = PageBook(LAYOUT, 3, 60, "cpu")
    book.begin(torch.tensor([50, 61, 20], dtype=torch.int32))
    assert book.status.tolist() == [0, STATUS_FULL, 0], "61 tokens pass the slot's 60"
    assert _lengths(book.in_step) == _split([50, 61, 20])
    assert _lengths(book.committed) == _split([0, 0, 0]), "readers between steps see the committed lengths"
    book.flag(torch.tensor([0, 0, STATUS_NONFINITE], dtype=torch.int32))
    book.commit(torch.tensor([50, 61, 20], dtype=torch.int32))
    assert book.seq_len.tolist() == [50, 0, 0]
    assert _lengths(book.committed) == _split([50, 0, 0])
    book.begin(3)
    assert book.status.tolist() == [0, 0, 0], "begin clears the last step's flags"
    book.commit(3)
    assert book.seq_len.tolist() == [53, 3, 3] and _lengths(book.committed) == _split([53, 3, 3])


def test_reset_and_assign_a_slot():
    book = PageBook(LAYOUT, 2, 100, "cpu")
    book.begin(70)
    book.commit(70)
    book.reset(1)
    assert book.seq_len.tolist() == [70, 0] and _lengths(book.committed) == _split([70, 0])
    book.reset_all()
    assert book.seq_len.tolist() == [0, 0]
    book.assign(0, torch.tensor([9, 4], dtype=torch.int64))
    assert book.block_table[0, :2].tolist() == [9, 4] and book.block_table.dtype == torch.int32
    assert book.block_table[0, 2:].tolist() == list(range(2, book.max_pages)), "the rest of the row is kept"
    st = PagedKV.allocate(LAYOUT, 2, book.num_pool_pages, book.max_pages)
    view = book.state_view(st, book.in_step)
    assert view.block_table is book.block_table and view.num_pages is book.in_step.num_pages
    assert view.k_codes is st.k_codes


def test_bad_sizes_and_slots_raise():
    with pytest.raises(ValueError, match="expected > 0, got 0, 10"):
        PageBook(LAYOUT, 0, 10, "cpu")
    book = PageBook(LAYOUT, 2, 100, "cpu")
    for slot in (2, -1, True, 1.0):
        with pytest.raises(IndexError, match="expected an int in 0..1"):
            book.reset(slot)
    with pytest.raises(ValueError, match=rf"page_ids: expected \[<= {book.max_pages}\]"):
        book.assign(0, torch.arange(book.max_pages + 1))
