"""plugins/trtllm/bookkeeping.py (the previous host-side book, kept for tests/gpu/test_aot_gpu.py only) against
the layout and the reference cache writer. The adapter itself: test_trtllm_contract.py."""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.trtllm.bookkeeping import OscarCacheBook, PagePool, PoolExhausted, pages_per_seq_for, pool_pages_for

from conftest import BOUNDARY_LENGTHS

LAYOUT = KVCacheLayout.default(2, 64)  # S0 64, W 256, P 64


def test_page_pool_order_and_errors():
    pool = PagePool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(PoolExhausted, match="3 pages"):
        pool.allocate()
    pool.release([1])
    assert pool.allocate() == 1
    with pytest.raises(ValueError, match=r"pages \[7\] are not allocated"):
        pool.release([7])
    with pytest.raises(ValueError, match="expected > 0"):
        PagePool(0)


@pytest.mark.parametrize("length", BOUNDARY_LENGTHS)
def test_book_follows_layout_split_token_by_token_and_in_one_prefill(length):
    a = OscarCacheBook(LAYOUT, max_batch=2, max_pages_per_seq=16, pool_pages=32)
    b = OscarCacheBook(LAYOUT, max_batch=2, max_pages_per_seq=16, pool_pages=32)
    a.add(1)
    b.add(1)
    steps = [d for _ in range(length) for d in a.grow(1, 1)]
    bulk = b.grow(1, length)
    assert [d.page for d in steps] == [d.page for d in bulk]
    assert a.split(1) == b.split(1) == LAYOUT.split(length)
    assert len(steps) == LAYOUT.pages_for(length)


@pytest.mark.parametrize("length", [1, 64, 385, 449, 777])
def test_book_matches_reference_cache_writer(length):
    """The reference writer (token by token, demoting when recent is full) ends in the book's state."""
    book = OscarCacheBook(LAYOUT, max_batch=1, max_pages_per_seq=16, pool_pages=16)
    book.add(0)
    st = PagedKV.allocate(LAYOUT, 1, pool_pages=16, max_pages=16, dtype=torch.float32)
    t = LayerTransform.identity(2, 64)
    pool = PagePool(16)
    k = torch.randn(2, length, 64)
    for i in range(length):
        reference.append_tokens(st, 0, k[:, i : i + 1], k[:, i : i + 1], LAYOUT, t, pool.allocate)
        book.grow(0, 1)
    tab = book.tables([0])
    assert [int(st.sink_len[0]), int(st.num_pages[0]), int(st.recent_len[0])] == [
        tab["sink_len"][0], tab["num_pages"][0], tab["recent_len"][0]]
    assert st.block_table[0, : tab["num_pages"][0]].tolist() == book.seqs[0].pages


@pytest.mark.parametrize("length", [383, 384, 385, 448, 449])
def test_reserve_next_matches_the_reference_demotion(length):
    """Update-step demotion (reserve_next before the token arrives) stores what the reference stores once
    the token is appended; before it, the state is the reference state with one page demoted early."""
    book = OscarCacheBook(LAYOUT, max_batch=1, max_pages_per_seq=16, pool_pages=16)
    book.add(0)
    book.grow(0, length)
    before = list(book.seqs[0].pages)
    dem = book.reserve_next(0)
    due = LAYOUT.pages_for(length + 1) > LAYOUT.pages_for(length)
    assert (dem is not None) == due
    if due:
        s, n, r = book.split(0)
        assert (n, r) == (len(before) + 1, LAYOUT.split(length)[2] - 64)
        assert book.seqs[0].pages == before + [dem.page]
    assert book.grow(0, 1) == []  # the page is already there
    assert book.split(0) == LAYOUT.split(length + 1)


def test_tables_ragged_batch_and_free():
    book = OscarCacheBook(LAYOUT, max_batch=3, max_pages_per_seq=8, pool_pages=12)
    for rid, n in ((10, 1), (11, 500), (12, 777)):
        book.add(rid)
        book.grow(rid, n)
    tab = book.tables([12, 10, 11])
    assert tab["num_pages"] == [LAYOUT.pages_for(777), 0, LAYOUT.pages_for(500)]
    assert tab["max_pages"] == LAYOUT.pages_for(777)
    assert all(len(row) == tab["max_pages"] for row in tab["block_table"])
    assert tab["block_table"][1] == [0] * tab["max_pages"]
    assert book.kv_bytes() == sum(LAYOUT.sequence_bytes(n) for n in (1, 500, 777))
    free_before = book.pool.free
    book.free(12)
    assert book.pool.free == free_before + LAYOUT.pages_for(777)
    assert book.add(13).slot == 2  # the freed slot is reused


def test_book_rejects_bad_input():
    book = OscarCacheBook(LAYOUT, max_batch=1, max_pages_per_seq=2, pool_pages=1)
    book.add(0)
    with pytest.raises(ValueError, match="already in the cache"):
        book.add(0)
    with pytest.raises(PoolExhausted, match="all 1 batch slots"):
        book.add(1)
    with pytest.raises(ValueError, match="expected >= 0"):
        book.grow(0, -1)
    assert book.max_length() == 64 + 2 * 64 + 320
    with pytest.raises(ValueError, match="exceed the block table"):
        book.grow(0, book.max_length() + 1)
    assert not book.can_grow(0, 64 + 320 + 2 * 64)  # needs 2 pages, the pool has 1
    with pytest.raises(PoolExhausted, match="needs 2 pages, 1 are free"):
        book.grow(0, 64 + 320 + 2 * 64)
    assert book.seqs[0].length == 0  # nothing recorded on failure
    with pytest.raises(ValueError, match="must be > 0"):
        OscarCacheBook(LAYOUT, max_batch=0, max_pages_per_seq=2, pool_pages=1)


def test_pool_sizing():
    assert pages_per_seq_for(LAYOUT, 8192) == LAYOUT.pages_for(8192)
    assert pool_pages_for(LAYOUT, 4, 8192) == 4 * LAYOUT.pages_for(8192)
    assert pool_pages_for(LAYOUT, 4, 10) == 1
