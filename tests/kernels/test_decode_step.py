"""The decode step's cache write (``decode_append``: token + demotion when due) and the page book's commit.

The Triton kernel must leave every cache buffer ``torch.equal`` to ``reference.decode_append``, and the
reference must leave the same cache as one bulk ``reference.append_tokens`` of the same tokens. A step that
the book does not commit (NaN/Inf, a full slot) must leave what the committed lengths read unchanged. On
the CPU the kernel runs through Triton's interpreter (tests/kernels/conftest.py), on the H200 compiled.
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, PagedKV, RowFormat
from oscar_export.kernels.pages import STATUS_FULL, STATUS_NONFINITE
from oscar_export.kernels.transform import LayerTransform

from helpers import BUFFERS, appends_equal_reference, assert_equal, book_state, decode_steps, random_transform


def _layout(gran: str) -> KVCacheLayout:
    return KVCacheLayout(2, 64, RowFormat(64, 64, gran), RowFormat(64, 64), sink=16, window=16, page_size=16)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("gran", ["token", "channel"])
def test_reference_decode_append_equals_bulk_append(gran, bits):
    """Token by token through the book == one bulk write of the same rows (ragged lengths, demotions)."""
    lay, tr = _layout(gran).with_key_bits(bits), LayerTransform.identity(2, 64, k_clip=0.9, v_clip=0.95)
    bsz, steps = 3, 70  # 70 > S0 + W + P: several demotions per slot
    book, st = book_state(lay, bsz, 200, "cpu")
    k, v = decode_steps(lambda s, k, v, status: ref.decode_append(s, k, v, status, lay, tr), lay, tr, book, st,
                         steps, bsz, seed=1)
    assert book.seq_len.tolist() == [steps] * bsz
    _, bulk = book_state(lay, bsz, 200, "cpu")
    bulk.block_table.copy_(book.block_table)
    for b in range(bsz):
        ref.append_tokens(bulk, b, k[b].bfloat16().float(), v[b].bfloat16().float(), lay, tr)
    committed = book.state_view(st, book.committed)
    for b in range(bsz):
        ka, va = ref.read_sequence(committed, lay, b, tr.k_levels, tr.v_levels)
        kb, vb = ref.read_sequence(bulk, lay, b, tr.k_levels, tr.v_levels)
        assert_equal(f"{gran} keys of {b}", ka, kb)
        assert_equal(f"{gran} values of {b}", va, vb)


def test_uncommitted_steps_leave_the_cache_as_it_was():
    """A NaN in one slot, a full slot: those slots read back exactly as before; the others move on."""
    lay, tr = _layout("channel"), LayerTransform.identity(2, 64)
    book, st = book_state(lay, 3, 60, "cpu", dtype=torch.float32)
    append = lambda s, k, v, status: ref.decode_append(s, k, v, status, lay, tr)  # noqa: E731
    decode_steps(append, lay, tr, book, st, 47, 3, seed=2)  # 47 = S0 + W + P - 1: the second step demotes
    book.seq_len[2] = 60  # slot 2 is full
    book.commit(0)
    before = [ref.read_sequence(book.state_view(st, book.committed), lay, b, tr.k_levels, tr.v_levels)
              for b in range(3)]
    for step in range(2):  # the second step demotes in slot 0 and 1
        k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
        k[1, 1, 7] = float("nan")
        book.begin(1)
        ref.decode_append(book.state_view(st, book.committed), k, v, book.status, lay, tr)
        book.commit(1)
        assert book.status.tolist() == [0, STATUS_NONFINITE, STATUS_FULL], book.status
    assert book.seq_len.tolist() == [49, 47, 60]
    assert book.committed.num_pages.tolist() == [1, 0, 1]
    for b in (1, 2):
        now = ref.read_sequence(book.state_view(st, book.committed), lay, b, tr.k_levels, tr.v_levels)
        assert_equal(f"keys of slot {b}", now[0], before[b][0])
        assert_equal(f"values of slot {b}", now[1], before[b][1])


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_triton_decode_append_matches_reference(ds, device, gran):
    """Every buffer of the Triton write equal to the reference's, over demotions and the sink boundary."""
    lay, tr = _layout(gran), LayerTransform.identity(2, 64, k_clip=0.9, v_clip=0.95)
    steps = 52
    book_r, book_g = appends_equal_reference(ds, device, lay, tr, 2, steps, 100, 3, gran)
    assert book_g.seq_len.tolist() == book_r.seq_len.tolist() == [steps, steps]


@pytest.mark.parametrize("d,g", [(128, 64), (256, 128)])
def test_triton_decode_append_two_groups_per_row(ds, device, d, g):
    """``G < D`` (Gemma 3: head_dim 256, two groups of 128): every buffer equal to the reference's."""
    lay = KVCacheLayout(2, d, RowFormat(d, g), RowFormat(d, g), sink=16, window=16, page_size=16)
    tr = LayerTransform.identity(2, d, k_clip=0.9, v_clip=0.95)
    # 52 steps > S0 + W + P: demotions of both slots
    book_r, _ = appends_equal_reference(ds, device, lay, tr, 2, 52, 100, 5, f"d={d} g={g}")
    assert int(book_r.committed.num_pages.min()) >= 1, "the test must demote"


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_triton_decode_append_mma16_matches_reference(ds, device, gran):
    """The demotion writes mma16 pages (keys tokens-on-M, values dims-on-M) equal to the reference's."""
    lay = KVCacheLayout(2, 64, RowFormat(64, 64, gran, packing="mma16"), RowFormat(64, 64, packing="mma16"),
                        sink=16, window=32, page_size=32)
    tr = LayerTransform.identity(2, 64, k_clip=0.9, v_clip=0.95)
    # 150 steps > S0 + W + P + P: two demotions per slot
    book_r, _ = appends_equal_reference(ds, device, lay, tr, 2, 150, 200, 4, f"mma16 {gran}")
    assert int(book_r.committed.num_pages.min()) >= 2


@pytest.mark.parametrize("gran,d,g", [("token", 64, 64), ("channel", 64, 64), ("token", 128, 64)])
def test_triton_decode_append_4bit_keys_matches_reference(ds, device, gran, d, g):
    """4-bit key pages (``layout.with_key_bits(4)``; values 2-bit): every buffer equal to the reference's."""
    lay = KVCacheLayout(2, d, RowFormat(d, g, gran), RowFormat(d, g), sink=16, window=16, page_size=16)
    lay = lay.with_key_bits(4)
    tr = LayerTransform.identity(2, d, k_clip=0.9, v_clip=0.95)

    def check(book_r, st_r, st_g):
        assert tuple(st_g.k_codes.shape[-1:]) == (d // 2,)
        assert int(book_r.committed.num_pages.min()) >= 1, "the test must demote"
        assert int(ref.unpack_codes(st_r.k_codes, g, 4).max()) > 3, "the key pages must use 4-bit codes"

    # 52 steps > S0 + W + P: demotions of both slots
    appends_equal_reference(ds, device, lay, tr, 2, 52, 100, 6, f"4-bit keys {gran} d={d}", check)


def test_triton_fused_transform_and_nonfinite_flag(ds, device):
    """Keys transformed in the kernel (R_K, d_K, mu_K) and mu_V removed: the windows within one BF16 rounding
    of the reference's (fp32 FMA order differs from torch.matmul), and a NaN/Inf row flags and writes nothing."""
    lay = _layout("token")
    tr = random_transform(2, 64)
    book_r, st_r = book_state(lay, 2, 100, "cpu")
    book_g, st_g = book_state(lay, 2, 100, device)
    k_r, _ = decode_steps(lambda s, k, v, status: ref.decode_append(
        s, tr.transform_keys(k.unsqueeze(2)).squeeze(2), v - tr.v_mean, status, lay, tr), lay, tr, book_r, st_r,
        20, 2, seed=4)
    trd = tr.to(device)
    decode_steps(lambda s, k, v, status: ds.decode_append(s, k, v, status, lay, trd, fused_transform=True), lay, tr,
                  book_g, st_g, 20, 2, seed=4)
    for f in ("sink_k", "recent_k"):
        got, want = getattr(st_g, f).cpu().float(), getattr(st_r, f).float()
        ulp = want.abs().clamp(min=1e-3) * 2**-7
        assert ((got - want).abs() <= ulp).all(), f"{f}: {(got - want).abs().max()}"
    assert_equal("sink_v", st_g.sink_v.cpu(), st_r.sink_v)
    before = st_g.sink_k.clone()
    k = torch.randn(2, 2, 64, device=device)
    k[0, 0, 0] = float("inf")
    book_g.begin(1)
    ds.decode_append(book_g.state_view(st_g, book_g.committed), k, k.clone(), book_g.status, lay, trd,
                     fused_transform=True)
    assert book_g.status.tolist() == [STATUS_NONFINITE, 0]
    assert_equal("sink_k of the flagged slot", st_g.sink_k[0].cpu(), before[0].cpu())


@pytest.mark.parametrize("gq,d", [(1, 64), (3, 64), (4, 128), (16, 64)])
def test_triton_query_rotation_once_a_step(ds, device, gq, d):
    """With ``q``, the append launch also returns ``(q @ R_K) / d_K`` per KV head (fp32: within a few fp32 ulps of
    the float64 product, the FMA order differing from torch.matmul), for every row, a flagged one included; the
    cache writes are those of the launch without ``q``."""
    lay = KVCacheLayout(2, d, RowFormat(d, d), RowFormat(d, d), sink=16, window=16, page_size=16)
    tr = random_transform(2, d, seed=gq)
    trd = tr.to(device)
    g = torch.Generator().manual_seed(gq)
    q = torch.randn(3, 2 * gq, d, generator=g).to(torch.bfloat16)
    k, v = torch.randn(3, 2, d, generator=g), torch.randn(3, 2, d, generator=g)
    want = (q.double().view(3, 2, gq, d) @ tr.k_rotation.double()[None]) / tr.k_scale.double()[None, :, None, :]
    want = want.view(3, 2 * gq, d)
    assert torch.allclose(ds.rotate_queries(q, tr).double(), want, rtol=1e-5, atol=1e-5)
    states = []
    for with_q in (True, False):
        book, st = book_state(lay, 3, 64, device)
        book.status[1] = STATUS_NONFINITE  # a row that writes nothing still gets its query rotated
        out = ds.decode_append(st, k.to(device), v.to(device), book.status, lay, trd, fused_transform=True,
                               q=q.to(device) if with_q else None)
        states.append(st)
        if not with_q:
            assert out is None
            continue
        assert out.dtype == torch.float32 and out.shape == (3, 2 * gq, d)
        err = (out.cpu().double() - want).abs()
        bound = 1e-5 * (q.double().abs().view(3, 2, gq, d).sum(-1, keepdim=True) + 1).view(3, 2 * gq, 1)
        assert (err <= bound).all(), f"worst error {err.max().item():.3g} at {divmod(int(err.argmax()), d)}"
    for f in BUFFERS:
        assert_equal(f"{f} with and without q", getattr(states[0], f).cpu(), getattr(states[1], f).cpu())


def test_decode_append_bad_inputs(ds, device):
    lay = _layout("token")
    book, st = book_state(lay, 2, 64, device)
    tr = LayerTransform.identity(2, 64).to(device)
    k = torch.randn(2, 2, 64, device=device)
    with pytest.raises(ValueError, match=r"k: expected shape \[2, 2, 64\]"):
        ds.decode_append(st, k[:, :1], k, book.status, lay, tr)
    with pytest.raises(ValueError, match="v: expected a contiguous"):
        ds.decode_append(st, k, k.transpose(0, 1).contiguous().transpose(0, 1), book.status, lay, tr)
    with pytest.raises(ValueError, match="status: expected dtype torch.int32"):
        ds.decode_append(st, k, k, book.status.long(), lay, tr)
    st.recent_k = st.recent_k.float()
    with pytest.raises(ValueError, match="state.recent_k: expected dtype torch.bfloat16"):
        ds.decode_append(st, k, k, book.status, lay, tr)
    bad = KVCacheLayout(2, 64, RowFormat(64, 64), RowFormat(64, 64), sink=16, window=24, page_size=16)
    with pytest.raises(NotImplementedError, match="multiple of P"):
        ds.decode_append(PagedKV.allocate(bad, 2, 4, 2, device=device), k, k, book.status, bad, tr)
    wide_v = KVCacheLayout(2, 64, RowFormat(64, 64), RowFormat(64, 64, bits=4), sink=16, window=16, page_size=16)
    with pytest.raises(NotImplementedError, match="values are 2-bit"):
        ds.decode_append(PagedKV.allocate(wide_v, 2, 4, 2, device=device), k, k, book.status, wide_v, tr)
    with pytest.raises(ValueError,
                       match=r"q: expected \[2, H_kv \* GQ \(GQ <= 64\), 64\] with H_kv=2, got \[2, 3, 64\]"):
        ds.decode_append(st, k, k, book.status, lay, tr, q=torch.randn(2, 3, 64, device=device))
    with pytest.raises(ValueError, match="q: expected dtype"):
        ds.decode_append(st, k, k, book.status, lay, tr, q=torch.randn(2, 4, 64, device=device).double())
    with pytest.raises(ValueError, match="q: expected a contiguous"):
        ds.decode_append(st, k, k, book.status, lay, tr, q=torch.randn(2, 64, 4, device=device).transpose(1, 2))
    k4 = lay.with_key_bits(4)
    with pytest.raises(ValueError, match=r"state.k_codes: expected shape \[\d+, 2, 16, 32\], got \[\d+, 2, 16, 16\]"):
        ds.decode_append(PagedKV.allocate(lay, 2, 4, 2, device=device), k, k, book.status, k4, tr)


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_triton_nonfinite_in_one_head_writes_no_head(ds, device, gran):
    """A token whose NaN sits in its last KV head only: no head of it is written (the programs of the other
    heads may run first), exactly as the reference; the sequence beside it is written. Steps chosen so that
    the flagged step is due to demote a page (recent ring full)."""
    lay, tr = _layout(gran), LayerTransform.identity(2, 64, k_clip=0.9, v_clip=0.95)
    book_r, st_r = book_state(lay, 2, 100, "cpu")
    book_g, st_g = book_state(lay, 2, 100, device)
    trd = tr.to(device)
    steps = lay.sink + lay.recent_capacity  # the next token demotes
    decode_steps(lambda s, k, v, status: ref.decode_append(s, k, v, status, lay, tr), lay, tr, book_r, st_r,
                  steps, 2, seed=5)
    decode_steps(lambda s, k, v, status: ds.decode_append(s, k, v, status, lay, trd), lay, tr, book_g, st_g,
                  steps, 2, seed=5)
    k = torch.randn(2, 2, 64)
    v = torch.randn(2, 2, 64)
    v[0, 1, 5] = float("nan")
    for book, st, fn, dev in ((book_r, st_r, lambda *a: ref.decode_append(*a, lay, tr), "cpu"),
                              (book_g, st_g, lambda *a: ds.decode_append(*a, lay, trd), device)):
        book.begin(1)
        fn(book.state_view(st, book.committed), k.to(dev), v.to(dev), book.status)
        assert book.status.tolist() == [STATUS_NONFINITE, 0]
    for f in BUFFERS:
        assert_equal(f"{gran} {f}", getattr(st_g, f).cpu(), getattr(st_r, f))
