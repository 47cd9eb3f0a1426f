"""The HF cache's ``"triton"`` backend (plugins/hf/triton_backend.py, the ``get_ops("triton")`` cache ops): prompt
writes and demoting chunks leave the reference's cache bit for bit; the decode step's append launch rotates the
queries and the attention reads them as given. On the CPU through Triton's interpreter (``helpers.kernel_module``)."""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, PagedKV, RowFormat
from oscar_export.kernels.transform import LayerTransform

from helpers import BUFFERS, assert_equal, book_state, random_transform


def test_hf_triton_backend_writes_equal_reference(qp, device):
    """``backend="triton"`` prompt writes (pages quantized by the kernel), a whole prompt and then chunks that
    demote, leave the reference's cache bit for bit."""
    from types import SimpleNamespace

    from oscar_export.plugins.hf.ops import get_ops

    ops = get_ops("triton")
    lay = KVCacheLayout(2, 64, RowFormat(64, 64, "channel"), RowFormat(64, 64), sink=16, window=16, page_size=16)
    tr = LayerTransform.identity(2, 64, k_clip=0.9, v_clip=0.95)
    a = PagedKV.allocate(lay, 2, 12, 6)
    a.block_table.copy_(torch.arange(12, dtype=torch.int32).view(2, 6))
    g = PagedKV(**{f: getattr(a, f).clone().to(device) for f in a.__dataclass_fields__})
    layer = SimpleNamespace(layout=lay, transform=tr.to(device))
    for b, t in enumerate([100, 30]):
        pos = 0
        for n in [t] + [1] * 5 + [7, 9]:  # a prompt, then chunks of 1, 7 and 9 tokens (demotions on the way)
            k, v = torch.randn(2, n, 64), torch.randn(2, n, 64)
            ref.write_tokens(a, b, pos, k, v, lay, tr)
            plan = ref.plan_writes(lay, [(b, pos, n)], g.block_table.shape[1], device)
            ops.write_planned(layer, g, plan, k.to(device), v.to(device))
            pos += n
        assert lay.pages_for(pos) >= 1
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        assert_equal(f"backend {f}", getattr(g, f).cpu(), getattr(a, f))


@pytest.mark.parametrize("rotated", [False, True])
def test_hf_triton_backend_rotates_the_queries_in_the_append_launch(ds, device, rotated):
    """The HF ``"triton"`` ops (``oscar::decode_append`` / ``oscar::decode_attention``): ``decode_append`` returns
    what the append wrapper's own rotation returns (bitwise: the same launch) and writes what it writes, or ``q``
    itself where the keys are the identity; ``decode_attention`` reads those stored-basis queries as given, bitwise
    the portable kernel without a query rotation (no split program rotates)."""
    from types import SimpleNamespace

    from oscar_export.kernels.decode import portable
    from oscar_export.plugins.hf.cache import TransformFlags
    from oscar_export.plugins.hf.ops import get_ops

    ops = get_ops("triton")
    lay = KVCacheLayout(2, 64, RowFormat(64, 64, "channel"), RowFormat(64, 64), sink=16, window=16, page_size=16)
    tr = (random_transform(2, 64, seed=7) if rotated else LayerTransform.identity(2, 64, 0.9, 0.95)).to(device)
    layer = SimpleNamespace(layout=lay, transform=tr, flags=TransformFlags.of(tr))
    assert layer.flags.keys_identity is not rotated
    book_h, st_h = book_state(lay, 2, 100, device)
    book_w, st_w = book_state(lay, 2, 100, device)
    g = torch.Generator().manual_seed(8)
    for t in range(52):  # past a demotion
        q = torch.randn(2, 8, 64, generator=g).bfloat16().to(device)
        k, v = (torch.randn(2, 2, 64, generator=g).to(device) for _ in range(2))
        for book in (book_h, book_w):
            book.begin(1)
        q_s = ops.decode_append(layer, book_h.state_view(st_h, book_h.committed), k, v, q, book_h.status)
        want = ds.decode_append(book_w.state_view(st_w, book_w.committed), k, v, book_w.status, lay, tr,
                                fused_transform=True, q=q if rotated else None)
        for book in (book_h, book_w):
            book.commit(1)
        if rotated:
            assert q_s.dtype == torch.float32 and torch.equal(q_s, want)
        else:
            assert q_s is q
    for f in BUFFERS:
        assert_equal(f"rotated={rotated} {f}", getattr(st_h, f).cpu(), getattr(st_w, f).cpu())
    assert int(book_h.committed.num_pages.min()) >= 1, "the steps must demote"
    step = book_h.state_view(st_h, book_h.committed)
    got = ops.decode_attention(layer, q_s, step, 0.125)
    assert torch.equal(got, portable.decode_attention(q_s, step, lay, tr.k_levels, tr.v_levels, 0.125,
                                                      out_dtype=q_s.dtype))
