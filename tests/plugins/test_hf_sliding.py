"""Gemma 3's sliding-window layers in the OSCAR cache (plugins/hf/sliding.py) on a tiny random-weight model.

Built from transformers' real ``Gemma3TextConfig`` with interleaved layers (the first and last slide, window 8):
chunked prompts and decode steps give DynamicCache's logits, the memory report splits OSCAR and sliding parts,
an uncommitted step leaves every sliding ring as the committed length reads it, and past the OSCAR windows only
the global layers hold INT2 pages.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.pages import STATUS_NONFINITE
from oscar_export.plugins.hf import OscarCache, cache_kwargs, enable_oscar
from oscar_export.plugins.hf.sliding import SlidingLayer

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

V, W = 96, 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma(**kw):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=64, sliding_window=W, layer_types=LAYER_TYPES,
        max_position_embeddings=1024, eos_token_id=None, architectures=["Gemma3ForCausalLM"], **kw)
    return transformers.Gemma3ForCausalLM(cfg).float().eval()


def forward(model, ids, cache, **kw):
    with torch.no_grad():
        return model(ids, use_cache=True, **kw, **cache_kwargs(model, cache)).logits.double()


def test_chunks_and_decode_equal_dynamic_cache():
    """A 13-token prompt, a 6-token chunk (its first query sees ring tokens of the prompt) and 5 decode steps
    (the ring wraps): logits equal DynamicCache's to fp32 noise at every position."""
    model = gemma()
    ids = torch.randint(1, V, (1, 24))
    parts = [ids[:, :13], ids[:, 13:19]] + [ids[:, i : i + 1] for i in range(19, 24)]
    ref, ours = DynamicCache(config=model.config), None
    with enable_oscar(model) as oscar:
        ours = oscar.make_cache(1, 64)
        assert [type(layer).__name__ for layer in ours.layers] == ["SlidingLayer", "OscarLayer"] * 2 + ["SlidingLayer"]
        for part in parts:
            got = forward(model, part, ours)
            model.set_attn_implementation("sdpa")
            want = forward(model, part, ref)
            model.set_attn_implementation("oscar")
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert ours.sequence_lengths() == [24]


def test_memory_is_split_into_oscar_and_sliding_parts():
    model = gemma()
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(2, 64)
        forward(model, torch.randint(1, V, (2, 11)), cache)
    mem = cache.memory()
    assert mem["oscar_allocated"] + mem["sliding_allocated"] + mem["book_allocated"] == cache.allocated_bytes()
    per_ring = 2 * 2 * 2 * W * 256 * 4  # K and V, B 2, H_kv 2, W entries, D 256, fp32
    assert mem["sliding_allocated"] == 3 * per_ring
    assert mem["sliding_kv"] == 3 * 2 * (2 * 2 * 256 * 4) * W  # 11 tokens held, the ring keeps W per slot
    assert mem["oscar_kv"] == 2 * 2 * oscar.layout.sequence_bytes(11)
    assert cache.kv_bytes() == mem["oscar_kv"] + mem["sliding_kv"]


def test_uncommitted_step_leaves_the_rings_as_they_were():
    """A decode step whose input makes the layers' keys NaN is not committed: every ring entry the committed
    length reads (positions n - W + 1 .. n - 1) is unchanged, and the next good step equals DynamicCache."""
    model = gemma()
    ids = torch.randint(1, V, (1, 14))
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 64)
        forward(model, ids[:, :13], cache)
        rings = [(layer.k.clone(), layer.v.clone()) for layer in cache.layers if isinstance(layer, SlidingLayer)]
        emb = model.model.embed_tokens.weight
        saved = emb[5].clone()
        with torch.no_grad():
            emb[5] = float("nan")
        forward(model, torch.tensor([[5]]), cache)
        with torch.no_grad():
            emb[5] = saved
        assert cache.step_status().tolist() == [STATUS_NONFINITE] and cache.sequence_lengths() == [13]
        visible = torch.arange(13 - W + 1, 13) % W
        for (k0, v0), layer in zip(rings, [la for la in cache.layers if isinstance(la, SlidingLayer)]):
            assert torch.equal(layer.k[:, :, visible], k0[:, :, visible])
            assert torch.equal(layer.v[:, :, visible], v0[:, :, visible])
        # transformers' own position counter (get_seq_length) counted the failed column: pass the position
        got = forward(model, ids[:, 13:14], cache, position_ids=torch.tensor([[13]]))
    model.set_attn_implementation("sdpa")
    ref = DynamicCache(config=model.config)
    forward(model, ids[:, :13], ref)
    torch.testing.assert_close(got, forward(model, ids[:, 13:14], ref), atol=1e-4, rtol=1e-4)


def test_past_the_windows_only_global_layers_hold_pages():
    """Small OSCAR windows: 60 tokens put INT2 pages in the two global layers; the sliding layers hold W tokens."""
    model = gemma()
    layout = KVCacheLayout.default(2, 256, "token", sink=4, window=16, page_size=16)
    with enable_oscar(model, layout=layout) as oscar:
        cache = oscar.make_cache(1, 80)
        out = model.generate(torch.randint(1, V, (1, 40)), max_new_tokens=21, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True, **cache_kwargs(model, cache))
    n = 40 + 21 - 1
    assert bool(torch.isfinite(torch.stack(out.scores)).all())
    assert [int(la.state.num_pages[0]) for la in cache.oscar_layers] == [layout.pages_for(n)] * 2 == [2, 2]
    assert cache.memory()["oscar_kv"] == 2 * layout.sequence_bytes(n)


def test_cache_refuses_a_model_with_another_window():
    """A cache made directly (no owner) for one window, used by a model with another: the layer names both; one
    made by a setup is refused by any other model first."""
    model = gemma()
    with enable_oscar(model) as oscar:
        owned = oscar.make_cache(1, 32)
        cache = OscarCache(oscar.layout, oscar.transforms, 1, 32, sliding_layers=oscar.shape.sliding_layers,
                           sliding_window=oscar.shape.sliding_window)
    other = gemma()
    other.config.sliding_window = W + 1
    for layer in other.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = W + 1
    with enable_oscar(other):
        with pytest.raises(ValueError, match=r"layer 0: the model slides over 9 tokens, its cache layer over 8"):
            forward(other, torch.randint(1, V, (1, 5)), cache)
        with pytest.raises(ValueError, match="cache: made by another model's enable_oscar setup"):
            forward(other, torch.randint(1, V, (1, 5)), owned)


@pytest.mark.parametrize("kind", ["oscar", "sliding"])
def test_every_layer_checks_new_tokens_alike(kind):
    """Sliding and OSCAR layers check new keys and values with one check: integer keys and values of another shape
    are refused by both."""
    model = gemma()
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 32)
    layer = next(la for la in cache.layers if (type(la).__name__ == "SlidingLayer") == (kind == "sliding"))
    k = torch.zeros(1, 2, 3, 256)
    with pytest.raises(ValueError, match="key_states: expected a float dtype"):
        layer.update(k.long(), k)
    with pytest.raises(ValueError, match=r"value_states: expected \[1, 2, 3, 256\] like the keys"):
        layer.update(k, torch.zeros(1, 2, 4, 256))
    with pytest.raises(ValueError, match=r"key_states: expected \[1, 2, T, 256\]"):
        layer.update(torch.zeros(1, 3, 3, 256), k)
