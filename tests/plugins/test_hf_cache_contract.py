"""Issue 31: the cache never answers from what it did not store, or from a slot it was not asked for.

A cache too small for ``generate`` stops with one error (not 30 tokens decoded from a cache that stored none of
them); slot indices are ints, never bools; sizes are bounded before anything is allocated; a cache outliving its
setup fails with one clear error.
"""

from __future__ import annotations

import time

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf import OscarCache, cache_kwargs, enable_oscar

from helpers import SMALL_LAYOUT, tiny_hf_model

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")


def _generate(model, ids, cache, new):
    return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))


def test_generate_with_too_small_a_cache_stops_with_one_error():
    """Issue: make_cache(1, prompt + 10) and 40 new tokens: 40 came back, the last 30 from a cache that held none."""
    model = tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 24))
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        with pytest.raises(ValueError, match=r"sequence slot 0: the cache is full \(max_length=34 tokens stored\)"):
            _generate(model, ids, oscar.make_cache(1, 24 + 10), 40)
        exact = _generate(model, ids, oscar.make_cache(1, 24 + 39), 40)  # the 40th token is never fed back
    assert exact.shape[1] == 24 + 40


def test_the_host_bound_follows_prompts_resets_and_decode_steps():
    model = tiny_hf_model("llama")
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        cache = oscar.make_cache(2, 20)
        with torch.no_grad():
            model(torch.randint(1, 96, (2, 18)), **cache_kwargs(model, cache))
            assert cache.host_lengths == [18, 18]
            for _ in range(2):
                model(torch.randint(1, 96, (2, 1)), **cache_kwargs(model, cache))
            assert cache.host_lengths == cache.sequence_lengths() == [20, 20]
            with pytest.raises(ValueError, match="sequence slot 0: the cache is full"):
                model(torch.randint(1, 96, (2, 1)), **cache_kwargs(model, cache))
            assert cache.sequence_lengths() == [20, 20]
            cache.reset_sequence(0)
            cache.reset_sequence(1)
            with cache.select([1]):
                model(torch.randint(1, 96, (1, 5)), **cache_kwargs(model, cache))
            assert cache.host_lengths == cache.sequence_lengths() == [0, 5]


@pytest.mark.parametrize("bad", [True, False, 1.0, torch.tensor(1)], ids=["True", "False", "float", "tensor"])
def test_slot_indices_are_ints_not_bools(bad):
    """Issue: reset_sequence(True) on a batch of 3 set every slot's length to 0."""
    layout = KVCacheLayout.default(2, 16, sink=4, window=16, page_size=16)
    cache = OscarCache(layout, [LayerTransform.identity(2, 16)], 3, 64)
    cache.book.seq_len.copy_(torch.tensor([5, 6, 7]))
    with pytest.raises(IndexError, match="sequence slot: expected an int in 0..2"):
        cache.reset_sequence(bad)
    with pytest.raises(IndexError, match="sequence slot: expected an int in 0..2"):
        with cache.select([bad]):
            pass
    assert cache.sequence_lengths() == [5, 6, 7]


def test_sizes_are_bounded_before_allocation():
    """Issue: make_cache of 1e6 slots grew to 23 GB until the OOM killer stopped it."""
    model = tiny_hf_model("llama")
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        t0 = time.perf_counter()
        with pytest.raises(MemoryError, match=r"an OscarCache of 1,000,000 slots x 1,000,000 tokens needs about"):
            oscar.make_cache(10**6, 10**6)
        with pytest.raises(ValueError, match="expected at most 1,048,576 slots"):
            oscar.make_cache(1 << 21, 16)
        assert time.perf_counter() - t0 < 1


def test_a_cache_used_after_restore_fails_with_one_clear_error():
    """Issue: AttributeError: 'LayerStep' object has no attribute 'shape'."""
    model = tiny_hf_model("llama")
    oscar = enable_oscar(model, layout=SMALL_LAYOUT)
    cache = oscar.make_cache(1, 64)
    oscar.restore()
    msg = r"an OscarCache reached attention that is not OSCAR's .*setup.restore\(\)"
    with pytest.raises(AttributeError, match=msg):
        with torch.no_grad():
            model(torch.randint(1, 96, (1, 8)), **cache_kwargs(model, cache))


def test_the_readme_refill_pattern_keeps_every_slots_positions():
    """Issue: after ``cache.reset_sequence(1); with cache.select([1]): model(new_prompt)`` the next decode step was
    off by up to 9.4 in the logits (7.95 for the untouched slot): positions came from the columns the cache had
    seen, not from each slot's length. Now a forward without position_ids takes them from the slot lengths."""
    model = tiny_hf_model("llama")
    torch.manual_seed(1)
    first = torch.randint(1, 96, (2, 20))
    steps = torch.randint(1, 96, (3, 2, 1))
    new_prompt = torch.randint(1, 96, (1, 7))
    nxt = torch.randint(1, 96, (2, 1))
    with torch.no_grad(), enable_oscar(model) as oscar:  # default windows: nothing quantized, exact comparison
        cache = oscar.make_cache(2, 64)
        kw = cache_kwargs(model, cache)
        model(first, **kw)
        for s in steps:
            model(s, **kw)
        cache.reset_sequence(1)
        with cache.select([1]):
            model(new_prompt, **kw)  # the README's line, as written: no position_ids
        got = model(nxt, **kw).logits[:, -1]
    with torch.no_grad():  # each sequence alone, no cache
        want0 = model(torch.cat([first[:1], *[s[:1] for s in steps], nxt[:1]], 1)).logits[0, -1]
        want1 = model(torch.cat([new_prompt, nxt[1:]], 1)).logits[0, -1]
    torch.testing.assert_close(got[0], want0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want1, atol=1e-4, rtol=1e-4)
