"""The HF cache layer without a model: pages, windows, host mirrors, attention against an oracle, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf.attention import attend
from oscar_export.plugins.hf.cache import OscarLayer, PageAllocator, PoolExhausted
from conftest import GQA_SHAPES, HEAD_DIMS

SMALL = dict(sink=4, window=16, page_size=16)  # windows small enough that a few dozen tokens reach INT2


def small_layout(h_kv: int = 2, d: int = 32, granularity: str = "token") -> KVCacheLayout:
    return KVCacheLayout.default(h_kv, d, granularity, **SMALL)


def rotated_transform(h_kv: int, d: int, seed: int = 0, prerotated: bool = False) -> LayerTransform:
    """Per-head random orthogonal K/V rotations, scalings, means and clipping: every term of the basis change."""
    g = torch.Generator().manual_seed(seed)
    rot = lambda: torch.linalg.qr(torch.randn(h_kv, d, d, generator=g))[0].contiguous()  # noqa: E731
    pos = lambda: (0.5 + torch.rand(h_kv, d, generator=g))  # noqa: E731
    return LayerTransform(
        k_rotation=rot(), v_rotation=rot(), k_scale=pos(), v_scale=pos(),
        k_mean=0.1 * torch.randn(h_kv, d, generator=g), v_mean=0.1 * torch.randn(h_kv, d, generator=g),
        k_clip=torch.full((h_kv,), 0.95), v_clip=torch.full((h_kv,), 0.9),
        k_levels=torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(h_kv, 4).contiguous(),
        v_levels=torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(h_kv, 4).contiguous(),
        values_prerotated=prerotated,
    )


def expected_contents(layout: KVCacheLayout, tr: LayerTransform, k: torch.Tensor, v: torch.Tensor):
    """What a sequence that was written ``k, v [H_kv, L, D]`` (stored basis) must read back, built independently:
    sink and recent rows as written, history rows quantized page by page and dequantized."""
    n = k.shape[1]
    s0, pages, _ = layout.split(n)
    p = layout.page_size
    hist = slice(s0, s0 + pages * p)

    def roundtrip(x, fmt, clip, levels):
        if pages == 0:
            return x[:, hist]
        xp = x[:, hist].reshape(x.shape[0], pages, p, x.shape[2]).transpose(0, 1)  # [N, H_kv, P, D]
        codes, params = reference.quantize_pages(xp, fmt, clip, levels)
        back = reference.dequantize_pages(codes, params, fmt, levels)
        return back.transpose(0, 1).reshape(x.shape[0], pages * p, x.shape[2])

    kk = torch.cat([k[:, :s0], roundtrip(k, layout.key, tr.k_clip, tr.k_levels), k[:, hist.stop :]], 1)
    vv = torch.cat([v[:, :s0], roundtrip(v, layout.value, tr.v_clip, tr.v_levels), v[:, hist.stop :]], 1)
    return kk, vv


def assert_reads_back(layer: OscarLayer, written: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every sequence reads back exactly its expected contents; host mirrors equal the device lengths."""
    lay = layer.layout
    for b in range(layer.batch_size):
        k_w, v_w = written.get(b, (None, None))
        n = 0 if k_w is None else k_w.shape[1]
        assert layer.lengths[b] == n
        split = lay.split(n)
        got = (int(layer.state.sink_len[b]), int(layer.state.num_pages[b]), int(layer.state.recent_len[b]))
        assert got == split, f"sequence {b}: device lengths {got}, host mirror {split}"
        assert layer.state.block_table[b, : split[1]].tolist() == layer.pages[b]
        k, v = layer.read_sequence(b)
        assert k.shape[1] == n
        if n == 0:
            continue
        ek, ev = expected_contents(lay, layer.transform, k_w, v_w)
        for name, a, e in (("K", k, ek), ("V", v, ev)):
            if not torch.equal(a, e):
                diff = (a - e).abs()
                worst = diff.flatten().topk(min(5, diff.numel()))
                raise AssertionError(f"sequence {b} {name}: worst |diff| {worst.values.tolist()} at {worst.indices.tolist()}")
    held = [p for ps in layer.pages for p in ps]
    assert len(held) == len(set(held)), "a page is held by two sequences"
    assert layer.allocator.free_count + len(held) == layer.allocator.num_pages


# ---- the allocator --------------------------------------------------------------------------------------------


def test_allocator_free_list_and_errors():
    a = PageAllocator(3)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(PoolExhausted, match="all 3 pages are in use"):
        a.allocate()
    a.release([1])
    assert a.allocate() == 1
    with pytest.raises(ValueError, match="not allocated"):
        a.release([7])
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


# ---- writes: prefill / decode / free, property test ----------------------------------------------------------


def test_decode_appends_match_one_prefill():
    """T single-token decode appends and one T-token write leave identical contents (all boundary lengths)."""
    lay = small_layout()
    tr = rotated_transform(2, 32)
    n = 4 + 16 + 16 * 3 + 5  # sink, window, three pages, a few more
    k = torch.randn(3, 2, n, 32)
    v = torch.randn(3, 2, n, 32)
    by_decode = OscarLayer(lay, tr, 3, n)
    by_write = OscarLayer(lay, tr, 3, n)
    by_write.write({b: (k[b], v[b]) for b in range(3)})
    for t in range(n):
        by_decode.append_decode(k[:, :, t : t + 1], v[:, :, t : t + 1])
        if t + 1 in (1, 3, 4, 5, 20, 36, 37, 52, 53):
            assert_reads_back(by_decode, {b: (k[b, :, : t + 1], v[b, :, : t + 1]) for b in range(3)})
    for b in range(3):
        assert all(torch.equal(x, y) for x, y in zip(by_decode.read_sequence(b), by_write.read_sequence(b)))
    assert_reads_back(by_write, {b: (k[b], v[b]) for b in range(3)})


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_interleavings_read_back_exactly(granularity, seed):
    """Random appends (chunks and decode steps, i.e. demotions) and frees over 4 sequences sharing a small pool:
    after every operation every sequence reads back exactly what was written to it."""
    rng = random.Random(seed)
    lay = small_layout(granularity=granularity)
    tr = rotated_transform(2, 32, seed)
    layer = OscarLayer(lay, tr, 4, 120, pool_pages=12, overcommit=True)
    written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(30):
        op = rng.choice(["chunk", "decode", "decode", "free"])
        if op == "free":
            b = rng.randrange(4)
            layer.free(b)
            written.pop(b, None)
        elif op == "chunk":
            rows = {b: rng.randrange(1, 40) for b in rng.sample(range(4), rng.randrange(1, 4))}
            new = {b: (torch.randn(2, n, 32), torch.randn(2, n, 32)) for b, n in rows.items()}
            try:
                layer.write(new)
            except (PoolExhausted, ValueError):
                pass  # nothing may have changed: checked below
            else:
                for b, (k, v) in new.items():
                    old = written.get(b, (torch.empty(2, 0, 32), torch.empty(2, 0, 32)))
                    written[b] = (torch.cat([old[0], k], 1), torch.cat([old[1], v], 1))
        else:
            k, v = torch.randn(4, 2, 1, 32), torch.randn(4, 2, 1, 32)
            try:
                layer.append_decode(k, v)
            except (PoolExhausted, ValueError):
                pass
            else:
                for b in range(4):
                    old = written.get(b, (torch.empty(2, 0, 32), torch.empty(2, 0, 32)))
                    written[b] = (torch.cat([old[0], k[b]], 1), torch.cat([old[1], v[b]], 1))
        assert_reads_back(layer, written)


def test_pool_full_raises_and_changes_nothing():
    """S0=4, W=16, P=16: a sequence holds ceil((L - 36) / 16) pages; the pool has 3."""
    lay = small_layout()
    layer = OscarLayer(lay, rotated_transform(2, 32), 2, 200, pool_pages=3, overcommit=True)
    k, v = torch.randn(2, 2, 70, 32), torch.randn(2, 2, 70, 32)
    written = {0: (k[0, :, :68], v[0, :, :68])}
    layer.write({0: written[0]})
    assert len(layer.pages[0]) == lay.pages_for(68) == 2
    with pytest.raises(PoolExhausted, match="needs 3 pages, 1 of 3 are free"):
        layer.write({1: (k[1, :, :69], v[1, :, :69])})
    assert_reads_back(layer, written)
    written[1] = (k[1, :, :52], v[1, :, :52])
    layer.write({1: written[1]})  # 1 page: the pool is full, both sequences sit at a demotion edge
    with pytest.raises(PoolExhausted, match="needs 2 pages, 0 of 3 are free"):
        layer.append_decode(k[:, :, 68:69], v[:, :, 68:69])
    assert_reads_back(layer, written)
    layer.free(0)
    layer.append_decode(k[:, :, 68:69], v[:, :, 68:69])  # sequence 0 restarts in the sink, 1 demotes
    written = {0: (k[0, :, 68:69], v[0, :, 68:69]),
               1: (torch.cat([written[1][0], k[1, :, 68:69]], 1), torch.cat([written[1][1], v[1, :, 68:69]], 1))}
    assert_reads_back(layer, written)


def test_pool_too_small_for_batch_and_length():
    with pytest.raises(ValueError, match="page pool too small: 2 sequences of 100 tokens need 8 pages"):
        OscarLayer(small_layout(), LayerTransform.identity(2, 32), 2, 100, pool_pages=7)


def test_max_length_is_enforced():
    layer = OscarLayer(small_layout(), LayerTransform.identity(2, 32), 1, 10)
    layer.write({0: (torch.randn(2, 10, 32), torch.randn(2, 10, 32))})
    with pytest.raises(ValueError, match="11 tokens exceed the cache's max_length=10"):
        layer.append_decode(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    assert layer.lengths == [10]


def test_nan_keys_are_rejected_before_any_write():
    lay = small_layout()
    layer = OscarLayer(lay, LayerTransform.identity(2, 32), 2, 200)
    good = torch.randn(2, 30, 32)
    bad = good.clone()
    bad[1, 7, 3] = float("nan")
    with pytest.raises(ValueError, match="keys of sequence 1: 1 non-finite"):
        layer.write({0: (good, good), 1: (bad, good)})
    assert layer.lengths == [0, 0]
    inf = good.clone()
    inf[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="values of sequence 0"):
        layer.write({0: (good, inf)})
    # decode: a NaN sitting in the recent window is caught when it reaches the quantizer (demotion)
    k, v = torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    k[1, 0, 10, 0] = float("nan")
    for t in range(lay.sink + lay.recent_capacity):
        layer.append_decode(k[:, :, t : t + 1], v[:, :, t : t + 1])
    before = [layer.read_sequence(b)[1].clone() for b in range(2)]
    with pytest.raises(ValueError, match=r"keys of sequence 1 \(demotion\): 1 non-finite"):
        layer.append_decode(k[:, :, 36:37], v[:, :, 36:37])
    assert layer.lengths == [36, 36] and layer.pages == [[], []]
    assert torch.equal(layer.read_sequence(0)[1], before[0])


def test_nan_in_a_sink_token_is_rejected_at_decode():
    """Sink tokens are never quantized (so never reach the demotion check): a NaN there is caught on append."""
    lay = small_layout()
    layer = OscarLayer(lay, LayerTransform.identity(2, 32), 2, 200)
    k, v = torch.randn(2, 2, 3, 32), torch.randn(2, 2, 3, 32)
    layer.append_decode(k[:, :, :1], v[:, :, :1])
    v[0, 1, 1, 5] = float("nan")
    before = [layer.read_sequence(b)[1].clone() for b in range(2)]
    with pytest.raises(ValueError, match=r"values of sequence 0 \(sink\): 1 non-finite"):
        layer.append_decode(k[:, :, 1:2], v[:, :, 1:2])
    assert layer.lengths == [1, 1]
    for b in range(2):
        assert torch.equal(layer.read_sequence(b)[1], before[b])


@pytest.mark.parametrize(
    "k_shape, dtype, match",
    [
        ((2, 2, 1, 32), torch.float32, r"key_states: expected \[1, 2, T, 32\], got \[2, 2, 1, 32\]"),
        ((1, 3, 1, 32), torch.float32, r"expected \[1, 2, T, 32\], got \[1, 3, 1, 32\]"),
        ((1, 2, 1, 16), torch.float32, r"got \[1, 2, 1, 16\]"),
        ((1, 2, 32), torch.float32, r"got \[1, 2, 32\]"),
        ((1, 2, 1, 32), torch.int64, "expected a float dtype, got torch.int64"),
    ],
)
def test_update_rejects_bad_shapes_and_dtypes(k_shape, dtype, match):
    layer = OscarLayer(small_layout(), LayerTransform.identity(2, 32), 1, 50)
    k = torch.zeros(k_shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        layer.update(k, k)
    with pytest.raises(ValueError, match="value_states: expected"):
        layer.update(torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 2, 32))
    assert layer.seen == 0


def test_constructor_rejects_bad_arguments():
    tr = LayerTransform.identity(2, 32)
    with pytest.raises(ValueError, match="batch_size and max_length"):
        OscarLayer(small_layout(), tr, 0, 10)
    with pytest.raises(ValueError, match="float dtype"):
        OscarLayer(small_layout(), tr, 1, 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="transform: expected H_kv=2, D=32, got H_kv=3, D=32"):
        OscarLayer(small_layout(), LayerTransform.identity(3, 32), 1, 10)


# ---- attention against an independent oracle ------------------------------------------------------------------


def oracle(q, k_ctx, v_ctx, tr: LayerTransform, scale: float, causal_tail: int = 0) -> torch.Tensor:
    """Attention of ``q [H, Tq, D]`` (model basis) over ``k_ctx, v_ctx [H_kv, Tk, D]`` (stored basis) in fp64;
    the last ``causal_tail`` keys are the chunk itself (causal), returns ``[H, Tq, D]`` model basis."""
    h, tq, d = q.shape
    hkv = k_ctx.shape[0]
    g = h // hkv
    qs = tr.transform_queries(q[None])[0].double()
    s = torch.einsum("hqd,hkd->hqk", qs, k_ctx.double().repeat_interleave(g, 0)) * scale
    if causal_tail:
        tk = k_ctx.shape[1]
        pos_k = torch.arange(tk) - (tk - causal_tail)
        s = s.masked_fill(pos_k[None, None, :] > torch.arange(tq)[None, :, None], float("-inf"))
    o = torch.einsum("hqk,hkd->hqd", s.softmax(-1), v_ctx.double().repeat_interleave(g, 0))
    return tr.restore_output(o.float()[None])[0]


@pytest.mark.parametrize("h, h_kv", GQA_SHAPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_and_chunk_attention_match_oracle(h, h_kv, d):
    """Prefill, then a chunk reading INT2 history, then decode steps past a demotion, all against fp64 oracles
    built from independently quantized history."""
    lay = KVCacheLayout.default(h_kv, d, **SMALL)
    tr = rotated_transform(h_kv, d, seed=h + d)
    layer = OscarLayer(lay, tr, 2, 200)
    scale = d**-0.5
    n0, n1, steps = 45, 23, 3  # 45: one page; chunk of 23 reads it; the first decode step demotes
    n = n0 + n1 + steps
    q, k, v = torch.randn(2, h, n, d), torch.randn(2, h_kv, n, d), torch.randn(2, h_kv, n, d)
    k_s, v_s = tr.transform_keys(k), tr.transform_values(v)

    out = attend(layer, q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], None, scale)  # prefill: full precision
    for b in range(2):
        want = oracle(q[b, :, :n0], k_s[b, :, :n0], v_s[b, :, :n0], tr, scale, causal_tail=n0)
        torch.testing.assert_close(out[b], want, atol=2e-5, rtol=1e-4)

    out = attend(layer, q[:, :, n0 : n0 + n1], k[:, :, n0 : n0 + n1], v[:, :, n0 : n0 + n1], None, scale)
    for b in range(2):
        ek, ev = expected_contents(lay, tr, k_s[b, :, :n0], v_s[b, :, :n0])
        ek = torch.cat([ek, k_s[b, :, n0 : n0 + n1]], 1)
        ev = torch.cat([ev, v_s[b, :, n0 : n0 + n1]], 1)
        want = oracle(q[b, :, n0 : n0 + n1], ek, ev, tr, scale, causal_tail=n1)
        torch.testing.assert_close(out[b], want, atol=2e-5, rtol=1e-4)

    for t in range(n0 + n1, n):
        out = attend(layer, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], None, scale)
        for b in range(2):
            ek, ev = expected_contents(lay, tr, k_s[b, :, : t + 1], v_s[b, :, : t + 1])
            want = oracle(q[b, :, t : t + 1], ek, ev, tr, scale)
            torch.testing.assert_close(out[b], want, atol=2e-5, rtol=1e-4)
    assert layer.lengths == [n, n] and len(layer.pages[0]) == lay.pages_for(n) == 3


def test_padded_chunk_strips_pads_per_sequence():
    """A left-padded batch prefill and a chunk with pads give each sequence what it gets alone."""
    lay = small_layout(2, 32)
    tr = rotated_transform(2, 32, 5, prerotated=True)
    scale = 32**-0.5
    lens = [30, 41]
    n = 41
    q, k, v = torch.randn(2, 4, n, 32), torch.randn(2, 2, n, 32), torch.randn(2, 2, n, 32)
    pad = torch.zeros(2, n, dtype=torch.bool)
    for b, m in enumerate(lens):
        pad[b, n - m :] = True
    batch = OscarLayer(lay, tr, 2, 100)
    # prefill the first 25 columns, then a 16-column chunk; both carry pads for sequence 0
    o1 = attend(batch, q[:, :, :25], k[:, :, :25], v[:, :, :25], pad[:, :25], scale)
    o2 = attend(batch, q[:, :, 25:], k[:, :, 25:], v[:, :, 25:], pad, scale)
    out = torch.cat([o1, o2], 2)
    assert batch.lengths == lens
    for b, m in enumerate(lens):
        alone = OscarLayer(lay, tr, 1, 100)
        cut = 25 - (n - m)  # real tokens of sequence b in the first chunk
        sl = slice(n - m, n)
        a1 = attend(alone, q[b : b + 1, :, n - m : 25], k[b : b + 1, :, n - m : 25], v[b : b + 1, :, n - m : 25], None, scale)
        a2 = attend(alone, q[b : b + 1, :, 25:], k[b : b + 1, :, 25:], v[b : b + 1, :, 25:], None, scale)
        assert cut == a1.shape[2]
        torch.testing.assert_close(out[b : b + 1, :, sl], torch.cat([a1, a2], 2), atol=1e-5, rtol=1e-5)
        assert torch.equal(out[b, :, : n - m], torch.zeros_like(out[b, :, : n - m]))
        for x, y in zip(batch.read_sequence(b), alone.read_sequence(0)):
            torch.testing.assert_close(x, y, atol=0, rtol=0)



def test_attention_rejects_bad_queries_masks_and_indices():
    from oscar_export.plugins.hf.attention import oscar_attention

    layer = OscarLayer(small_layout(), LayerTransform.identity(2, 32), 2, 50)
    k = torch.randn(2, 2, 5, 32)
    with pytest.raises(ValueError, match=r"query: expected \[2, a multiple of 2, T, 32\], got \[2, 3, 5, 32\]"):
        attend(layer, torch.randn(2, 3, 5, 32), k, k, None, None)
    with pytest.raises(ValueError, match=r"attention_mask: expected a 2D padding mask \[2, >= 5\], got \[2, 4\]"):
        attend(layer, torch.randn(2, 4, 5, 32), k, k, torch.ones(2, 4, dtype=torch.bool), None)
    assert layer.lengths == [0, 0]
    step, _ = layer.update(k, k)
    with pytest.raises(NotImplementedError, match="inference-only"):
        oscar_attention(None, torch.randn(2, 4, 5, 32), step, k, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        oscar_attention(None, torch.randn(2, 4, 5, 32), step, k, None, sliding_window=8)
    with pytest.raises(IndexError, match="expected 0..1, got 2"):
        layer.free(2)
