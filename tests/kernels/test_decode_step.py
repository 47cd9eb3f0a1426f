"""Triton decode-step cache update (append + demotion when due) against ``kernels/reference.py``.

Every cache buffer must be ``torch.equal`` to ``reference.append_tokens`` of one token per sequence. On the
CPU this runs through Triton's interpreter (tests/kernels/conftest.py), on the H200 compiled.
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, PagedKV, RowFormat
from oscar_export.kernels.transform import LayerTransform


def _assert_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        pairs = [(idx, got[tuple(idx)].item(), want[tuple(idx)].item()) for idx in bad]
        raise AssertionError(f"{name}: {(got != want).sum().item()} mismatches, first (index, got, want): {pairs}")


def test_decode_step_update_matches_reference_appends(ds, device):
    """Ragged batch, both key granularities: every buffer equal to T single-token reference appends."""
    for gran in ("token", "channel"):
        lay = KVCacheLayout(2, 64, RowFormat(64, 64, gran), RowFormat(64, 64), sink=16, window=16, page_size=16)
        tr = LayerTransform.identity(2, 64, k_clip=0.9, v_clip=0.95)
        bsz, maxp, start = 3, 6, [0, 30, 47]  # 47 = S0 + W + P - 1: the first step demotes
        a = PagedKV.allocate(lay, bsz, bsz * maxp, maxp)
        for b, t in enumerate(start):
            if t:
                ids = iter(range(b * maxp, (b + 1) * maxp))
                ref.append_tokens(a, b, torch.randn(2, t, 64), torch.randn(2, t, 64), lay, tr, lambda: next(ids))
        g = PagedKV(**{f: getattr(a, f).clone().to(device) for f in a.__dataclass_fields__})
        g.block_table.copy_(torch.arange(bsz * maxp, dtype=torch.int32).view(bsz, maxp))  # reserved ahead
        for _ in range(20):
            k, v = torch.randn(bsz, 2, 64), torch.randn(bsz, 2, 64)
            for b in range(bsz):
                ids = iter(range(b * maxp + int(a.num_pages[b]), (b + 1) * maxp))
                ref.append_tokens(a, b, k[b, :, None], v[b, :, None], lay, tr, lambda: next(ids))
            ds.decode_step_update(g, k.to(device), v.to(device), lay, tr.to(device))
        assert a.num_pages.tolist() == [0, 1, 2], a.num_pages  # demotions happened on the way
        for f in a.__dataclass_fields__:
            got, want = getattr(g, f).cpu(), getattr(a, f)
            if f == "block_table":
                for b in range(bsz):
                    n = int(a.num_pages[b])
                    _assert_equal(f"{gran} block_table[{b}]", got[b, :n], want[b, :n])
            else:
                _assert_equal(f"{gran} {f}", got, want)


def test_decode_step_update_bad_inputs(ds, device):
    lay = KVCacheLayout(2, 64, RowFormat(64, 64), RowFormat(64, 64), sink=16, window=16, page_size=16)
    st = PagedKV.allocate(lay, 2, 4, 2, device=device)
    tr = LayerTransform.identity(2, 64).to(device)
    k = torch.randn(2, 2, 64, device=device)
    with pytest.raises(ValueError, match=r"k: expected shape \[2, 2, 64\]"):
        ds.decode_step_update(st, k[:, :1], k, lay, tr)
    with pytest.raises(ValueError, match="v: expected a contiguous"):
        ds.decode_step_update(st, k, k.transpose(0, 1).contiguous().transpose(0, 1), lay, tr)
    st.recent_k = st.recent_k.float()
    with pytest.raises(ValueError, match="state.recent_k: expected dtype torch.bfloat16"):
        ds.decode_step_update(st, k, k, lay, tr)
    bad = KVCacheLayout(2, 64, RowFormat(64, 64), RowFormat(64, 64), sink=16, window=24, page_size=16)
    with pytest.raises(NotImplementedError, match="multiple of P"):
        ds.decode_step_update(PagedKV.allocate(bad, 2, 4, 2, device=device), k, k, bad, tr)
