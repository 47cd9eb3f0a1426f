"""Packed writes of several sequences at once (kernels/reference/writers.py: ``plan_writes``, ``write_planned``,
``nonfinite_rows``): the bytes of one write per sequence, whatever the mix of sink, held ring tokens, new pages
and ring wrap-around in the batch."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform

#: a small layout: sink 16, recent window 16 + one page, pages of 16
LAYOUT = dict(sink=16, window=16, page_size=16)
SLOTS, PAGES = 5, 8


def committed_state(lay, tr, lengths):
    """A state whose sequence ``b`` holds ``lengths[b]`` random tokens (slot ``b`` owns pool pages ``8b ..``)."""
    state = PagedKV.allocate(lay, SLOTS, SLOTS * PAGES, PAGES)
    state.block_table.copy_(torch.arange(SLOTS * PAGES).view(SLOTS, PAGES))
    for b, n in enumerate(lengths):
        if n:
            ref.append_tokens(state, b, torch.randn(2, n, 64), torch.randn(2, n, 64), lay, tr)
    return state


def clone(state):
    return type(state)(**{f.name: getattr(state, f.name).clone() for f in fields(state)})


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_a_planned_batch_writes_the_bytes_of_one_write_per_sequence(granularity):
    """Five rows in one packing: a prompt into the sink only, one unwritten row (a padding request), a chunk whose
    new pages take tokens already in the ring, a long prompt straight into pages and the ring, one token that
    demotes a page: the state equals one ``write_tokens`` per sequence, and in token order the windows hold the
    new tokens exactly (in the windows' BF16)."""
    lay = KVCacheLayout.default(2, 64, granularity, **LAYOUT)
    tr = LayerTransform.identity(2, 64, 0.95, 0.9)
    torch.manual_seed(0)
    committed = [0, 0, 40, 0, 48]
    state = committed_state(lay, tr, committed)
    one = clone(state)
    rows = [(0, 0, 9), (None, 0, 7), (2, 40, 30), (3, 0, 100), (4, 48, 1)]
    total = sum(t for _, _, t in rows)
    k, v = torch.randn(2, total, 64), torch.randn(2, total, 64)
    plan = ref.plan_writes(lay, rows, PAGES, "cpu")
    assert plan.num_pages == 2 + 4 + 1  # 2: 70 tokens, 4: 100 tokens, 1: the 49th token demotes one
    ref.write_planned(state, plan, k, v, lay, tr)
    offset = 0
    for b, start, t in rows:
        if b is not None:
            ref.write_tokens(one, b, start, k[:, offset : offset + t], v[:, offset : offset + t], lay, tr)
        offset += t
    for f in fields(state):
        assert torch.equal(getattr(state, f.name), getattr(one, f.name)), f.name
    offset = 0
    for b, start, t in rows:
        if b is not None:
            state.sink_len[b], state.num_pages[b], state.recent_len[b] = lay.split(start + t)
            kt, _ = ref.read_sequence(state, lay, b, tr.k_levels, tr.v_levels)
            s0, pages, _ = lay.split(start + t)
            exact = [j for j in range(start, start + t) if j < s0 or j >= s0 + pages * 16]
            want = k[:, [offset + j - start for j in exact]].to(state.sink_k.dtype)  # the windows' dtype
            assert torch.equal(kt[:, exact].to(want.dtype), want), b
        offset += t


def test_a_plan_refuses_a_sequence_twice_and_pages_past_the_block_table():
    lay = KVCacheLayout.default(2, 64, **LAYOUT)
    with pytest.raises(ValueError, match="a sequence is listed twice"):
        ref.plan_writes(lay, [(1, 0, 4), (None, 0, 3), (1, 4, 4)], PAGES, "cpu")
    with pytest.raises(ValueError, match="sequence 2 needs 9 pages, its block table has 8"):
        ref.plan_writes(lay, [(0, 0, 4), (2, 0, 16 + 32 + 9 * 16)], PAGES, "cpu")
    with pytest.raises(ValueError, match=r"write plan for \(sink, recent, page\) \(16, 32, 16\)"):
        plan = ref.plan_writes(lay, [(0, 0, 4)], PAGES, "cpu")
        other = KVCacheLayout.default(2, 64, sink=32, window=16, page_size=16)
        ref.write_planned(PagedKV.allocate(other, 1, 1, 1), plan, torch.zeros(2, 4, 64), torch.zeros(2, 4, 64),
                          other, LayerTransform.identity(2, 64))


def test_nonfinite_rows_names_the_written_rows_holding_nan_or_inf():
    lay = KVCacheLayout.default(2, 64, **LAYOUT)
    plan = ref.plan_writes(lay, [(0, 0, 3), (None, 0, 2), (1, 5, 4), (2, 0, 2)], PAGES, "cpu")
    k, v = torch.zeros(2, 11, 64), torch.zeros(2, 11, 64)
    k[1, 4, 7] = float("nan")  # the unwritten row: not reported
    v[0, 6, 0] = float("inf")  # row 2
    assert ref.nonfinite_rows(plan, k, v).tolist() == [False, False, True, False]
