"""The HF cache (plugins/hf/cache.py): without a model, steps through ``attend`` per layer, reads back, all-or-nothing
steps, bad input; with a tiny model, what it refuses to answer from."""

from __future__ import annotations

import random

import pytest
import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.pages import STATUS_FULL, STATUS_NONFINITE
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf import cache_kwargs, enable_oscar
from oscar_export.plugins.hf.attention import attend
from oscar_export.plugins.hf.cache import OscarCache

from helpers import (
    SMALL_LAYOUT,
    attention_oracle,
    expected_contents,
    one_layer,
    rotated_transform,
    small_layout,
    tiny_hf_model,
)


def step(cache: OscarCache, q, k, v, padding=None, scale=None, per_layer=None):
    """One model step: ``attend`` in every layer in order (``per_layer(i) -> (q, k, v)`` overrides the inputs)."""
    out = None
    for layer in cache.layers:
        qi, ki, vi = per_layer(layer.index) if per_layer else (q, k, v)
        out = attend(layer, qi, ki, vi, padding, scale)
    return out


def assert_reads_back(cache: OscarCache, written: dict[int, tuple[torch.Tensor, torch.Tensor]], tr) -> None:
    """Every slot of every layer reads back exactly its expected contents (stored basis)."""
    for layer in cache.layers:
        for b, (k, v) in written.items():
            ek, ev = expected_contents(layer.layout, tr, k, v)
            gk, gv = layer.read_sequence(b)
            assert gk.shape == ek.shape, (b, gk.shape, ek.shape)
            torch.testing.assert_close(gk, ek, atol=0, rtol=0)
            torch.testing.assert_close(gv, ev, atol=0, rtol=0)


@pytest.mark.parametrize("rotated", [False, True])
def test_decode_steps_match_one_prompt(rotated):
    """T single-token decode steps and one T-token prompt leave the same contents (two layers, through every
    boundary): bit for bit with the identity transform; with a rotated one the fp32 basis change is computed on
    other shapes (``[B, H_kv, 1, D]`` vs ``[1, H_kv, T, D]``), so within fp32 rounding."""
    lay = small_layout()
    tr = rotated_transform(2, 32, 1) if rotated else LayerTransform.identity(2, 32, 0.95, 0.9)
    tol = dict(atol=1e-5, rtol=1e-5) if rotated else dict(atol=0, rtol=0)
    n = 70  # sink 4, window 16, pages of 16: several demotions
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, n, 32), torch.randn(2, 2, n, 32), torch.randn(2, 2, n, 32)
    by_prompt, _ = one_layer(lay, tr, 2, 100, layers=2)
    step(by_prompt, q, k, v)
    by_decode, _ = one_layer(lay, tr, 2, 100, layers=2)
    step(by_decode, q[:, :, :1], k[:, :, :1], v[:, :, :1])  # a 1-token forward is a decode step
    for t in range(1, n):
        step(by_decode, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert by_prompt.sequence_lengths() == by_decode.sequence_lengths() == [n, n]
    for la, lb in zip(by_prompt.layers, by_decode.layers):
        for b in range(2):
            for x, y in zip(la.read_sequence(b), lb.read_sequence(b)):
                torch.testing.assert_close(x, y, **tol)
    if not rotated:
        k_s, v_s = tr.transform_keys(k), tr.transform_values(v)
        assert_reads_back(by_decode, {b: (k_s[b], v_s[b]) for b in range(2)}, tr)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleavings_read_back_exactly(seed):
    """Random prompts into reset slots, decode steps, steps with a NaN in one slot of one layer, steps past
    max_length, resets: after every operation each slot of each layer reads back exactly what a fresh cache fed
    only the accepted tokens reads, and the next decode attention agrees with that fresh cache's."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # identity basis with clipping: a slot fed by prompts + decode steps and one fed by a single prompt then
    # agree bit for bit (a rotated basis is computed on other shapes: test_decode_steps_match_one_prompt)
    lay, tr = small_layout(granularity=rng.choice(["token", "channel"])), LayerTransform.identity(2, 32, 0.95, 0.9)
    nb, max_len = 3, 60
    cache, _ = one_layer(lay, tr, nb, max_len, layers=2)
    cache.check_room = lambda: None  # the device flags alone, as inside a compiled step (no host check there)
    accepted = {b: (torch.zeros(4, 0, 32), torch.zeros(2, 0, 32), torch.zeros(2, 0, 32)) for b in range(nb)}

    def check():
        fresh, _ = one_layer(lay, tr, nb, max_len, layers=2)
        for b, (qa, ka, va) in accepted.items():
            if ka.shape[1]:
                with fresh.select([b]):
                    step(fresh, qa[None], ka[None], va[None])
        assert cache.sequence_lengths() == fresh.sequence_lengths()
        for la, lb in zip(cache.layers, fresh.layers):
            for b in range(nb):
                for x, y in zip(la.read_sequence(b), lb.read_sequence(b)):
                    torch.testing.assert_close(x, y, atol=0, rtol=0)

    for _ in range(25):
        op = rng.choice(["prompt", "decode", "decode", "decode", "nan", "reset"])
        if op == "reset" or (op == "prompt"):
            b = rng.randrange(nb)
            cache.reset_sequence(b)
            accepted[b] = (torch.zeros(4, 0, 32), torch.zeros(2, 0, 32), torch.zeros(2, 0, 32))
            if op == "prompt":
                t = rng.randrange(2, 45)
                q, k, v = torch.randn(1, 4, t, 32), torch.randn(1, 2, t, 32), torch.randn(1, 2, t, 32)
                with cache.select([b]):
                    step(cache, q, k, v)
                accepted[b] = (q[0], k[0], v[0])
        else:
            q, k, v = torch.randn(nb, 4, 1, 32), torch.randn(nb, 2, 1, 32), torch.randn(nb, 2, 1, 32)
            bad = rng.randrange(nb) if op == "nan" else None
            layer_bad = rng.randrange(2)

            def inputs(i):
                if bad is None or i != layer_bad:
                    return q, k, v
                kb = k.clone()
                kb[bad, 1, 0, 3] = float("nan")
                return q, kb, v

            step(cache, q, k, v, per_layer=inputs)
            status = cache.step_status().tolist()
            for b in range(nb):
                full = accepted[b][1].shape[1] + 1 > max_len
                want = (STATUS_NONFINITE if b == bad else 0) | (STATUS_FULL if full else 0)
                assert status[b] == want, (op, b, status)
                if want == 0:
                    qa, ka, va = accepted[b]
                    accepted[b] = (torch.cat([qa, q[b, :, 0:1]], 1), torch.cat([ka, k[b, :, 0:1]], 1),
                                   torch.cat([va, v[b, :, 0:1]], 1))
        check()


def test_prompt_longer_than_max_length_and_nan_prompts_change_nothing():
    lay, tr = small_layout(), LayerTransform.identity(2, 32)
    cache, layer = one_layer(lay, tr, 2, 50, layers=2)
    q, k, v = torch.randn(2, 4, 30, 32), torch.randn(2, 2, 30, 32), torch.randn(2, 2, 30, 32)
    step(cache, q, k, v)
    before = [layer.read_sequence(b) for b in range(2)]
    with pytest.raises(ValueError, match="sequence slot 0: 30 \\+ 21 tokens exceed the cache's max_length=50"):
        step(cache, torch.randn(2, 4, 21, 32), torch.randn(2, 2, 21, 32), torch.randn(2, 2, 21, 32))
    bad = torch.randn(2, 2, 5, 32)
    bad[1, 0, 2, 0] = float("inf")
    with pytest.raises(ValueError, match="keys of sequence slot 1 \\(layer 1\\): [0-9]+ non-finite"):
        step(cache, torch.randn(2, 4, 5, 32), k[:, :, :5], v[:, :, :5],
             per_layer=lambda i: (torch.randn(2, 4, 5, 32), bad if i == 1 else k[:, :, :5], v[:, :, :5]))
    assert cache.sequence_lengths() == [30, 30]
    for b in range(2):
        for x, y in zip(layer.read_sequence(b), before[b]):
            torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_decode_past_max_length_is_flagged_and_stores_nothing():
    lay, tr = small_layout(), LayerTransform.identity(2, 32)
    cache, layer = one_layer(lay, tr, 1, 10)
    step(cache, torch.randn(1, 4, 10, 32), torch.randn(1, 2, 10, 32), torch.randn(1, 2, 10, 32))
    before = layer.read_sequence(0)
    with pytest.raises(ValueError, match="sequence slot 0: the cache is full"):  # eager: the host check
        step(cache, torch.randn(1, 4, 1, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    assert cache.sequence_lengths() == [10]
    cache.check_room = lambda: None  # inside a compiled step there is no host code: the device flag says it
    step(cache, torch.randn(1, 4, 1, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    assert cache.step_status().tolist() == [STATUS_FULL]
    assert cache.sequence_lengths() == [10]
    for x, y in zip(layer.read_sequence(0), before):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_slot_prefill_while_others_keep_their_sequences():
    """Reset slot 1 and prefill a new prompt into it: slot 0 is untouched, slot 1 equals a fresh prefill."""
    lay, tr = small_layout(), rotated_transform(2, 32, 3)
    cache, layer = one_layer(lay, tr, 2, 80)
    step(cache, torch.randn(2, 4, 40, 32), torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32))
    keep = layer.read_sequence(0)
    cache.reset_sequence(1)
    q, k, v = torch.randn(1, 4, 25, 32), torch.randn(1, 2, 25, 32), torch.randn(1, 2, 25, 32)
    with cache.select([1]):
        step(cache, q, k, v)
    fresh, fl = one_layer(lay, tr, 1, 80)
    step(fresh, q, k, v)
    assert cache.sequence_lengths() == [40, 25]
    for x, y in zip(layer.read_sequence(0), keep):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    for x, y in zip(layer.read_sequence(1), fl.read_sequence(0)):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_constructor_rejects_bad_arguments():
    tr = LayerTransform.identity(2, 32)
    with pytest.raises(ValueError, match="batch_size and max_length"):
        OscarCache(small_layout(), [tr], 0, 10)
    with pytest.raises(ValueError, match="batch_size and max_length"):
        OscarCache(small_layout(), [tr], 1, 10.0)
    with pytest.raises(ValueError, match="float dtype"):
        OscarCache(small_layout(), [tr], 1, 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="transform: expected H_kv=2, D=32, got H_kv=3, D=32"):
        OscarCache(small_layout(), [LayerTransform.identity(3, 32)], 1, 10)


# ---- per-layer key widths --------------------------------------------------------------------------------------


def test_mixed_key_bits_layers_store_read_and_attend_in_their_own_layout():
    """Layers with ``key_bits`` (2, 4, 2): each allocates and quantizes with ``layout.with_key_bits(b)`` (a 4-bit
    K pool is ``[N, H_kv, P, D / 2]``); prompt, chunk and decode steps past a demotion read back exactly the
    reference's pages of that layout (to fp32 rounding) and attend like the fp64 oracle over them; bytes follow each
    layout."""
    h, h_kv, d = 4, 2, 32
    lay = small_layout(h_kv, d, "channel")
    trs = [rotated_transform(h_kv, d, seed=i) for i in range(3)]
    cache = OscarCache(lay, trs, 2, 120, key_bits=(2, 4, 2))
    assert [layer.layout.key.bits for layer in cache.layers] == [2, 4, 2]
    assert cache.layers[1].layout == cache.layer_layout(1) == lay.with_key_bits(4)
    assert cache.layers[1].state.k_codes.shape[-1] == d // 2 and cache.layers[0].state.k_codes.shape[-1] == d // 4
    assert cache.layers[1].state.v_codes.shape == cache.layers[0].state.v_codes.shape
    scale = d**-0.5
    n0, n1, steps = 45, 23, 3
    n = n0 + n1 + steps
    q, k, v = torch.randn(3, 2, h, n, d), torch.randn(3, 2, h_kv, n, d), torch.randn(3, 2, h_kv, n, d)
    spans = [(0, n0), (n0, n0 + n1)] + [(t, t + 1) for t in range(n0 + n1, n)]
    for a, b in spans:
        outs = {}
        for layer in cache.layers:
            i = layer.index
            outs[i] = attend(layer, q[i, :, :, a:b], k[i, :, :, a:b], v[i, :, :, a:b], None, scale)
        if b - a == 1:  # a decode step: every layer against the oracle over its own layout's pages
            for i, layer in enumerate(cache.layers):
                for s in range(2):
                    ek, ev = expected_contents(layer.layout, trs[i], trs[i].transform_keys(k[i, s : s + 1, :, :b])[0],
                                               trs[i].transform_values(v[i, s : s + 1, :, :b])[0])
                    want = attention_oracle(q[i, s, :, a:b], ek, ev, trs[i], scale)
                    torch.testing.assert_close(outs[i][s], want, atol=2e-5, rtol=1e-4)
    for i, layer in enumerate(cache.layers):
        for s in range(2):
            ek, ev = expected_contents(layer.layout, trs[i], trs[i].transform_keys(k[i, s : s + 1])[0],
                                       trs[i].transform_values(v[i, s : s + 1])[0])
            gk, gv = layer.read_sequence(s)  # decode tokens were transformed one at a time: fp32 rounding
            torch.testing.assert_close(gk, ek, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gv, ev, atol=1e-5, rtol=1e-5)
    assert int(cache.layers[1].state.num_pages[0]) == lay.pages_for(n) == 3
    mem = cache.memory()
    assert mem["oscar_kv"] == 2 * (2 * lay.sequence_bytes(n) + lay.with_key_bits(4).sequence_bytes(n))
    assert mem["oscar_kv"] > 3 * 2 * lay.sequence_bytes(n)


def test_key_bits_refused_when_they_do_not_fit_the_layers():
    tr = LayerTransform.identity(2, 32)
    with pytest.raises(ValueError, match=r"key_bits: expected one per layer \(2\), got 1"):
        OscarCache(small_layout(), [tr, tr], 1, 10, key_bits=(4,))
    with pytest.raises(ValueError, match=r"key_bits: sliding layers \[0\] hold no pages; expected 2, got \[4\]"):
        OscarCache(small_layout(), [tr, tr], 1, 10, key_bits=(4, 2), sliding_layers=(0,), sliding_window=8)
    with pytest.raises(NotImplementedError, match="RowFormat.bits"):
        OscarCache(small_layout(), [tr, tr], 1, 10, key_bits=(3, 2))


# ---- the query rotation once a step ------------------------------------------------------------------------------


@pytest.mark.parametrize("rotated", [False, True])
def test_decode_append_returns_the_queries_in_the_stored_key_basis(rotated):
    """The ops contract: ``decode_append(layer, state, k, v, q, status)`` writes what it wrote without ``q`` and
    returns the step's queries in the stored key basis (``transform_queries(q)``; ``q`` itself where the keys are
    the identity); ``decode_attention(layer, q_s, ...)`` attends with ``q_s`` as given (it rotates nothing)."""
    from dataclasses import fields

    from oscar_export.plugins.hf.ops import get_ops

    ops = get_ops("torch")
    h_kv, d = 2, 32
    tr = rotated_transform(h_kv, d, seed=3) if rotated else LayerTransform.identity(h_kv, d, 0.95, 0.9)
    caches = [one_layer(small_layout(h_kv, d), tr, 2, 100)[1] for _ in range(2)]
    torch.manual_seed(4)
    for t in range(40):  # past a demotion
        q, k, v = torch.randn(2, 4, d), torch.randn(2, h_kv, d), torch.randn(2, h_kv, d)
        for layer in caches:
            layer.cache.book.begin(1)
        q_s = ops.decode_append(caches[0], caches[0].state, k, v, q, caches[0].cache.book.status)
        reference.decode_append(caches[1].state, tr.transform_keys(k.unsqueeze(2)).squeeze(2), v - tr.v_mean,
                                caches[1].cache.book.status, caches[1].layout, tr)
        for layer in caches:
            layer.cache.book.commit(1)
        if rotated:
            assert torch.equal(q_s, tr.transform_queries(q.unsqueeze(2)).squeeze(2))
        else:
            assert q_s is q
    for f in fields(caches[0].state):
        assert torch.equal(getattr(caches[0].state, f.name), getattr(caches[1].state, f.name)), f.name
    layer = caches[0]
    assert int(layer.state.num_pages[0]) >= 1, "the steps must demote"
    got = ops.decode_attention(layer, q_s, layer.state, d**-0.5)
    want = reference.decode_attention(q_s.float(), layer.state, layer.layout, tr.k_levels, tr.v_levels, d**-0.5)
    assert torch.equal(got, want)


# ---- the cache never answers from what it did not store, or from a slot it was not asked for --------------------
# A cache too small for ``generate`` stops with one error (not 30 tokens decoded from a cache that stored none of
# them); slot indices are ints, never bools; sizes are bounded before anything is allocated; a cache outliving its
# setup fails with one clear error.


def _generate(model, ids, cache, new):
    return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_generate_with_too_small_a_cache_stops_with_one_error():
    """make_cache(1, prompt + 10) and 40 new tokens: one error when the cache is full, no token from an empty one."""
    model = tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 24))
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        with pytest.raises(ValueError, match=r"sequence slot 0: the cache is full \(max_length=34 tokens stored\)"):
            _generate(model, ids, oscar.make_cache(1, 24 + 10), 40)
        exact = _generate(model, ids, oscar.make_cache(1, 24 + 39), 40)  # the 40th token is never fed back
    assert exact.shape[1] == 24 + 40


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
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


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("bad", [True, False, 1.0, torch.tensor(1)], ids=["True", "False", "float", "tensor"])
def test_slot_indices_are_ints_not_bools(bad):
    """Slot indices are ints: ``reset_sequence(True)`` is refused (as an index it would reset every slot)."""
    layout = KVCacheLayout.default(2, 16, sink=4, window=16, page_size=16)
    cache = OscarCache(layout, [LayerTransform.identity(2, 16)], 3, 64)
    cache.book.seq_len.copy_(torch.tensor([5, 6, 7]))
    with pytest.raises(IndexError, match="sequence slot: expected an int in 0..2"):
        cache.reset_sequence(bad)
    with pytest.raises(IndexError, match="sequence slot: expected an int in 0..2"):
        with cache.select([bad]):
            pass
    assert cache.sequence_lengths() == [5, 6, 7]


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_the_readme_refill_pattern_keeps_every_slots_positions():
    """After ``cache.reset_sequence(1); with cache.select([1]): model(new_prompt)`` every slot keeps its positions:
    a forward without position_ids takes them from each slot's length, not from the columns the cache has seen."""
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
