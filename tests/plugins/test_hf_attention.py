"""The HF attention (plugins/hf/attention.py) over the OSCAR cache without a model: decode and chunk attention
against an independent fp64 oracle, padded chunks, bad input."""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf.attention import attend

from helpers import (
    GQA_SHAPES,
    HEAD_DIMS,
    SMALL_WINDOWS,
    attention_oracle,
    expected_contents,
    one_layer,
    rotated_transform,
    small_layout,
)


@pytest.mark.parametrize("h, h_kv", GQA_SHAPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_and_chunk_attention_match_oracle(h, h_kv, d):
    """Prefill, then a chunk reading INT2 history, then decode steps past a demotion, all against fp64 oracles
    built from independently quantized history."""
    lay = KVCacheLayout.default(h_kv, d, **SMALL_WINDOWS)
    tr = rotated_transform(h_kv, d, seed=h + d)
    cache, layer = one_layer(lay, tr, 2, 200)
    scale = d**-0.5
    n0, n1, steps = 45, 23, 3  # 45: one page; chunk of 23 reads it; the first decode step demotes
    n = n0 + n1 + steps
    q, k, v = torch.randn(2, h, n, d), torch.randn(2, h_kv, n, d), torch.randn(2, h_kv, n, d)
    k_s, v_s = tr.transform_keys(k), tr.transform_values(v)

    out = attend(layer, q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], None, scale)  # prefill: full precision
    for b in range(2):
        want = attention_oracle(q[b, :, :n0], k_s[b, :, :n0], v_s[b, :, :n0], tr, scale, causal_tail=n0)
        torch.testing.assert_close(out[b], want, atol=2e-5, rtol=1e-4)

    out = attend(layer, q[:, :, n0 : n0 + n1], k[:, :, n0 : n0 + n1], v[:, :, n0 : n0 + n1], None, scale)
    for b in range(2):
        ek, ev = expected_contents(lay, tr, k_s[b, :, :n0], v_s[b, :, :n0])
        ek = torch.cat([ek, k_s[b, :, n0 : n0 + n1]], 1)
        ev = torch.cat([ev, v_s[b, :, n0 : n0 + n1]], 1)
        want = attention_oracle(q[b, :, n0 : n0 + n1], ek, ev, tr, scale, causal_tail=n1)
        torch.testing.assert_close(out[b], want, atol=2e-5, rtol=1e-4)

    for t in range(n0 + n1, n):
        out = attend(layer, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], None, scale)
        for b in range(2):
            ek, ev = expected_contents(lay, tr, k_s[b, :, : t + 1], v_s[b, :, : t + 1])
            want = attention_oracle(q[b, :, t : t + 1], ek, ev, tr, scale)
            torch.testing.assert_close(out[b], want, atol=2e-5, rtol=1e-4)
    assert cache.sequence_lengths() == [n, n] and int(layer.state.num_pages[0]) == lay.pages_for(n) == 3


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
    batch, bl = one_layer(lay, tr, 2, 100)
    # prefill the first 25 columns, then a 16-column chunk; both carry pads for sequence 0
    o1 = attend(bl, q[:, :, :25], k[:, :, :25], v[:, :, :25], pad[:, :25], scale)
    o2 = attend(bl, q[:, :, 25:], k[:, :, 25:], v[:, :, 25:], pad, scale)
    out = torch.cat([o1, o2], 2)
    assert batch.sequence_lengths() == lens
    for b, m in enumerate(lens):
        alone, al = one_layer(lay, tr, 1, 100)
        cut = 25 - (n - m)  # real tokens of sequence b in the first chunk
        sl = slice(n - m, n)
        rows = slice(n - m, 25)
        a1 = attend(al, q[b : b + 1, :, rows], k[b : b + 1, :, rows], v[b : b + 1, :, rows], None, scale)
        a2 = attend(al, q[b : b + 1, :, 25:], k[b : b + 1, :, 25:], v[b : b + 1, :, 25:], None, scale)
        assert cut == a1.shape[2]
        torch.testing.assert_close(out[b : b + 1, :, sl], torch.cat([a1, a2], 2), atol=1e-5, rtol=1e-5)
        assert torch.equal(out[b, :, : n - m], torch.zeros_like(out[b, :, : n - m]))
        for x, y in zip(bl.read_sequence(b), al.read_sequence(0)):
            torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_a_batch_of_prompts_is_written_once_a_layer(monkeypatch):
    """Three prompts in one forward (two long enough for pages, one left-padded): the layer quantizes their pages
    in one call (before: one call per prompt with pages) and each sequence reads back what it gets alone."""
    import oscar_export.kernels.reference.writers as writers

    lay = small_layout(2, 32)
    tr = rotated_transform(2, 32, 7)
    n, lens = 90, [90, 70, 20]
    q, k, v = torch.randn(3, 4, n, 32), torch.randn(3, 2, n, 32), torch.randn(3, 2, n, 32)
    pad = torch.zeros(3, n, dtype=torch.bool)
    for b, m in enumerate(lens):
        pad[b, n - m :] = True
    calls, write_pages = [], writers.write_pages
    monkeypatch.setattr(writers, "write_pages", lambda *a, **kw: calls.append(len(a[1])) or write_pages(*a, **kw))
    batch, bl = one_layer(lay, tr, 3, 128)
    attend(bl, q, k, v, pad, 32**-0.5)
    assert len(calls) == 1 and batch.sequence_lengths() == lens, calls
    monkeypatch.undo()
    for b, m in enumerate(lens):
        alone, al = one_layer(lay, tr, 1, 128)
        attend(al, q[b : b + 1, :, n - m :], k[b : b + 1, :, n - m :], v[b : b + 1, :, n - m :], None, 32**-0.5)
        for x, y in zip(bl.read_sequence(b), al.read_sequence(0)):
            assert torch.equal(x, y), b


def test_attention_rejects_bad_queries_masks_and_indices():
    from oscar_export.plugins.hf.attention import oscar_attention

    cache, layer = one_layer(small_layout(), LayerTransform.identity(2, 32), 2, 50)
    k = torch.randn(2, 2, 5, 32)
    with pytest.raises(ValueError, match=r"query: expected \[2, a multiple of 2, T, 32\], got \[2, 3, 5, 32\]"):
        attend(layer, torch.randn(2, 3, 5, 32), k, k, None, None)
    with pytest.raises(ValueError, match=r"attention_mask: expected a 2D padding mask \[2, >= 5\], got \[2, 4\]"):
        attend(layer, torch.randn(2, 4, 5, 32), k, k, torch.ones(2, 4, dtype=torch.bool), None)
    assert cache.sequence_lengths() == [0, 0]
    ls, _ = layer.update(k, k)
    with pytest.raises(NotImplementedError, match="inference-only"):
        oscar_attention(None, torch.randn(2, 4, 5, 32), ls, k, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        oscar_attention(None, torch.randn(2, 4, 5, 32), ls, k, None, sliding_window=8)
    with pytest.raises(IndexError, match="expected an int in 0..1, got 2"):
        cache.reset_sequence(2)
    with pytest.raises(IndexError, match="expected an int in 0..1, got -1"):
        cache.reset_sequence(-1)
    with pytest.raises(ValueError, match="expected distinct slot indices"):
        with cache.select([0, 0]):
            pass
