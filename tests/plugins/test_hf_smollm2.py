"""The HF path on the real SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, D 64), default layout
(sink 64, recent 256, pages of 64) and no artifact (identity transforms, per-channel keys)."""

from __future__ import annotations

from pydoc_data.topics import topics

import pytest
import torch
from transformers import DynamicCache

from oscar_export.plugins.hf import CacheOps, OscarCache, cache_kwargs, enable_oscar, get_ops

pytestmark = [pytest.mark.model, pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")]

#: Python documentation sections of 703, 824 and 902 SmolLM2 tokens: history well inside the INT2 pages.
LONG_TOPICS = ("class", "with", "raise")


def prompt_ids(tok, topic: str, n: int | None = None) -> torch.Tensor:
    ids = tok(topics[topic], return_tensors="pt").input_ids
    return ids if n is None else ids[:, :n]


def greedy(model, ids, cache=None, mask=None, n=32, **kw) -> torch.Tensor:
    extra = cache_kwargs(model, cache) if cache is not None else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, **extra, **kw)
    return out[:, ids.shape[1] :]


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros(len(prompts), t, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, t - p.shape[1] :] = p[0]
        mask[b, t - p.shape[1] :] = 1
    return ids, mask


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a != b).nonzero()
    return "identical" if len(d) == 0 else f"first mismatch at {d[0].tolist()}: {a.tolist()} vs {b.tolist()}"


def noise_ops() -> CacheOps:
    """The reference ops, except every INT2 page written gets uniformly random codes under its true (scale, lo):
    noise of the same scale in place of the quantized history."""
    base = get_ops("torch")
    gen = torch.Generator().manual_seed(0)

    def scramble(state, pages):
        idx = torch.tensor(pages, dtype=torch.long)
        for codes in (state.k_codes, state.v_codes):
            codes[idx] = torch.randint(0, 256, codes[idx].shape, generator=gen).to(torch.uint8)

    def write_tokens(layer, state, b, start, k_s, v_s):
        base.write_tokens(layer, state, b, start, k_s, v_s)
        lay = layer.layout
        scramble(state, state.block_table[b, lay.pages_for(start) : lay.pages_for(start + k_s.shape[1])].tolist())

    def decode_append(layer, state, k, v, q, status):
        lay = layer.layout
        due = [b for b in range(k.shape[0]) if int(state.sink_len[b]) >= lay.sink
               and int(state.recent_len[b]) == lay.recent_capacity]
        pages = [int(state.block_table[b, int(state.num_pages[b])]) for b in due]
        q_s = base.decode_append(layer, state, k, v, q, status)
        scramble(state, [p for b, p in zip(due, pages) if int(status[b]) == 0])
        return q_s

    return CacheOps("noise", write_tokens, decode_append, base.decode_attention, base.chunk_attention)


def test_inside_windows_identical_to_dynamic_cache(smollm2):
    model, tok = smollm2
    ids = prompt_ids(tok, "assert", 120)
    want = greedy(model, ids, DynamicCache(config=model.config), n=32)
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 320)
        got = greedy(model, ids, cache, n=32)
    assert torch.equal(got, want), first_mismatch(got, want)
    assert int(cache.layers[0].state.num_pages[0]) == 0


@pytest.mark.slow
def test_whole_windows_identical_to_dynamic_cache(smollm2):
    """Prompt 100 + 220 generated = 320 = S0 + W tokens, the longest sequence without INT2 pages."""
    model, tok = smollm2
    ids = prompt_ids(tok, "assert", 100)
    want = greedy(model, ids, DynamicCache(config=model.config), n=220, min_new_tokens=220)
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 320)
        got = greedy(model, ids, cache, n=220, min_new_tokens=220)
    assert torch.equal(got, want), first_mismatch(got, want)
    assert cache.sequence_lengths() == [319] and int(cache.layers[0].state.num_pages[0]) == 0


def teacher_forced(model, ids: torch.Tensor, want: torch.Tensor, cache) -> torch.Tensor:
    """Greedy choice at each of ``want``'s steps, decoding ``want`` itself through ``cache``: ``[1, N]`` tokens.
    Each step reads the cache as deployed (INT2 history, BF16 windows) after the same prefix as BF16."""
    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        picks = [model(ids, **kw).logits[:, -1].argmax(-1)]
        for t in range(want.shape[1] - 1):
            picks.append(model(want[:, t : t + 1], **kw).logits[:, -1].argmax(-1))
    return torch.stack(picks, 1)


@pytest.mark.slow
@pytest.mark.representative
def test_int2_history_beats_same_scale_noise(smollm2):
    """The first 32 greedy BF16 tokens after 703/824/902-token prompts: at each step (same prefix), OSCAR picks
    the BF16 token far more often than a cache whose INT2 rows are replaced by noise of the same scale (fails if
    the quantized history were ignored or garbled)."""
    model, tok = smollm2
    agree = {"oscar": [], "noise": []}
    for topic in LONG_TOPICS:
        ids = prompt_ids(tok, topic)
        want = greedy(model, ids, DynamicCache(config=model.config))
        with enable_oscar(model) as oscar:
            for name, backend in (("oscar", oscar.ops), ("noise", noise_ops())):
                cache = OscarCache(oscar.layout, oscar.transforms, 1, ids.shape[1] + 32, backend=backend)
                got = teacher_forced(model, ids, want, cache)
                assert int(cache.layers[0].state.num_pages[0]) >= 6  # >= 6 pages of INT2 history
                agree[name].append(int((got == want).sum()))
    print(f"greedy BF16 tokens matched (of 32, per prompt): {agree}")
    assert sum(agree["oscar"]) >= 72, agree  # >= 75 %
    assert sum(agree["oscar"]) >= sum(agree["noise"]) + 12, agree


@pytest.mark.slow
@pytest.mark.representative
def test_ragged_batch_equals_each_alone(smollm2):
    """Prompts of 400 tokens (INT2 history) and 150 tokens (windows only), left-padded, 12 greedy tokens."""
    model, tok = smollm2
    prompts = [prompt_ids(tok, "class", 400), prompt_ids(tok, "with", 150)]
    ids, mask = left_pad(prompts)
    with enable_oscar(model) as oscar:
        batch = greedy(model, ids, oscar.make_cache(2, 420), mask, n=12)
        for b, p in enumerate(prompts):
            alone = greedy(model, p, oscar.make_cache(1, 420), n=12)
            assert torch.equal(batch[b : b + 1], alone), f"sequence {b}: {first_mismatch(batch[b:b+1], alone)}"


@pytest.mark.slow
def test_chunked_prefill_reads_int2_history(smollm2):
    """A 902-token prompt fed as 700 tokens, then a 202-token chunk that reads 5 INT2 pages: at each of the next
    32 greedy BF16 steps (same prefix) the chunked cache still picks the BF16 token most of the time."""
    model, tok = smollm2
    ids = prompt_ids(tok, "raise")
    want = greedy(model, ids, DynamicCache(config=model.config))
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, ids.shape[1] + 32)
        with torch.no_grad():
            model(ids[:, :700], **cache_kwargs(model, cache))
        assert int(cache.layers[0].state.num_pages[0]) == oscar.layout.pages_for(700) == 5
        got = teacher_forced(model, ids[:, 700:], want, cache)
    agree = int((got == want).sum())
    print(f"chunked prefill: {agree}/32 greedy BF16 tokens matched")
    assert cache.sequence_lengths() == [ids.shape[1] + 31]
    assert agree >= 24, first_mismatch(got, want)


@pytest.mark.slow
def test_1500_generated_tokens_beyond_the_windows(smollm2):
    model, tok = smollm2
    ids = prompt_ids(tok, "class", 200)
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 200 + 1500)
        out = greedy(model, ids, cache, n=1500, min_new_tokens=1500)
    assert out.shape == (1, 1500)
    n = 200 + 1499
    assert cache.sequence_lengths() == [n]
    assert int(cache.layers[29].state.num_pages[0]) == oscar.layout.pages_for(n) == 21
    assert cache.kv_bytes() < 0.5 * cache.bf16_bytes()
