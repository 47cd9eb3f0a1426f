"""The HF path end to end on tiny random-weight Llama / Qwen2 / Qwen3 models (mechanics, not accuracy)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf import OscarCache, cache_kwargs, enable_oscar

from helpers import HF_MODEL, SMALL_LAYOUT, rotated_transform, tiny_hf_model

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

def generate(model, ids, cache=None, mask=None, **kw):
    kw = {"max_new_tokens": 30, "do_sample": False, "output_scores": True, "return_dict_in_generate": True, **kw}
    if cache is not None:
        kw.update(cache_kwargs(model, cache))
    out = model.generate(ids, attention_mask=mask, pad_token_id=0, **kw)
    return out.sequences[:, ids.shape[1] :], torch.stack(out.scores, 1)


def assert_same_generation(a, b, atol=1e-4):
    (ta, sa), (tb, sb) = a, b
    if not torch.equal(ta, tb):
        first = (ta != tb).nonzero()[0].tolist()
        raise AssertionError(f"tokens differ first at (batch, step) {first}:\n{ta}\n{tb}")
    torch.testing.assert_close(sa, sb, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_inside_windows_equals_dynamic_cache(kind):
    """Every token within sink + recent: greedy tokens identical, scores equal to fp32 noise."""
    model = tiny_hf_model(kind)
    ids = torch.randint(1, 96, (1, 24))
    want = generate(model, ids, DynamicCache(config=model.config))
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 64)
        got = generate(model, ids, cache)
    assert_same_generation(got, want)
    assert cache.sequence_lengths() == [24 + 30 - 1]
    assert model.config._attn_implementation == "sdpa"  # restored on exit


@pytest.mark.parametrize("prerotated", [False, True])
def test_basis_change_inside_windows_matches(prerotated):
    """Rotations, scalings, means (and folded value rotations) change the stored basis, not the outputs."""
    model = tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 20))
    want = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=12)
    transforms = [rotated_transform(2, 16, seed=i, prerotated=prerotated) for i in range(2)]
    if prerotated:  # what export does: v_proj emits v @ R_V * d_V per head, o_proj undoes it
        model = copy.deepcopy(model)
        with torch.no_grad():
            for layer, t in zip(model.model.layers, transforms):
                attn = layer.self_attn
                for h in range(2):
                    m = t.v_rotation[h] * t.v_scale[h][None, :]  # v_h -> v_h @ m
                    rows = slice(16 * h, 16 * (h + 1))
                    attn.v_proj.weight[rows] = m.T @ attn.v_proj.weight[rows]
                    for j in range(2 * h, 2 * h + 2):  # query heads reading KV head h
                        cols = slice(16 * j, 16 * (j + 1))
                        attn.o_proj.weight[:, cols] = attn.o_proj.weight[:, cols] @ torch.linalg.inv(m).T
    with enable_oscar(model) as oscar:
        cache = OscarCache(oscar.layout, transforms, 1, 64)
        got = generate(model, ids, cache, max_new_tokens=12)
    assert_same_generation(got, want, atol=2e-4)


def test_beyond_windows_runs_and_accounts_bytes():
    model = tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 50))
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        cache = oscar.make_cache(1, 120)
        tokens, scores = generate(model, ids, cache, max_new_tokens=60)
    n = 50 + 60 - 1
    assert tokens.shape == (1, 60) and bool(torch.isfinite(scores).all())
    assert cache.sequence_lengths() == [n]
    assert [int(layer.state.num_pages[0]) for layer in cache.layers] == [SMALL_LAYOUT.pages_for(n)] * 2 == [5, 5]
    lay = SMALL_LAYOUT
    assert cache.kv_bytes() == 2 * lay.sequence_bytes(n) < cache.bf16_bytes() == 2 * n * lay.bf16_token_bytes()


@pytest.mark.parametrize("sample", [False, True])
def test_ragged_batch_equals_each_sequence_alone(sample):
    """Left-padded prompts of 45 and 20 tokens, 14 new tokens each (past the windows): batch == alone."""
    model = tiny_hf_model("llama")
    lens = [45, 20]
    prompts = [torch.randint(1, 96, (1, n)) for n in lens]
    ids = torch.zeros(2, 45, dtype=torch.long)
    mask = torch.zeros(2, 45, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 45 - lens[b] :] = p[0]
        mask[b, 45 - lens[b] :] = 1
    kw = {"max_new_tokens": 14, "do_sample": sample, "top_k": 0}
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        torch.manual_seed(1)
        cache = oscar.make_cache(2, 80)
        batch = generate(model, ids, cache, mask, **kw)
        assert cache.sequence_lengths() == [n + 13 for n in lens]
        for b, p in enumerate(prompts):
            if sample:
                continue  # one RNG stream per batch: only greedy can be compared row by row
            alone = generate(model, p, oscar.make_cache(1, 80), **kw)
            assert_same_generation((batch[0][b : b + 1], batch[1][b : b + 1]), alone)
    if sample:  # sampling: the same seed gives the same tokens as the BF16 cache while inside the windows
        torch.manual_seed(1)
        short = generate(model, ids[:, -20:], DynamicCache(config=model.config), mask[:, -20:], **kw)
        with enable_oscar(model) as oscar:
            torch.manual_seed(1)
            got = generate(model, ids[:, -20:], oscar.make_cache(2, 80), mask[:, -20:], **kw)
        assert_same_generation(got, short)


def test_chunked_prefill_inside_windows_equals_dynamic_cache():
    """A prompt fed as 20 tokens, then 13 more through generate (chunk path), then decode."""
    model = tiny_hf_model("qwen3")
    ids = torch.randint(1, 96, (1, 33))
    want = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=10)
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 64)
        with torch.no_grad():
            model(ids[:, :20], **cache_kwargs(model, cache))
        assert cache.get_seq_length() == 20
        got = generate(model, ids, cache, max_new_tokens=10)
    assert_same_generation(got, want)


def test_chunk_reads_quantized_history():
    """Beyond the windows a second chunk reads INT2 pages: its logits differ from a full-precision prefill of
    the same tokens, and equal those of a cache whose pages hold the same codes (deterministic)."""
    model = tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 70))
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        logits = []
        for _ in range(2):
            cache = oscar.make_cache(1, 80)
            with torch.no_grad():
                model(ids[:, :60], **cache_kwargs(model, cache))
                logits.append(model(ids[:, 60:], **cache_kwargs(model, cache)).logits)
            assert SMALL_LAYOUT.pages_for(60) == 2
            assert int(cache.layers[0].state.num_pages[0]) == SMALL_LAYOUT.pages_for(70) == 3
        full = oscar.make_cache(1, 80)
        with torch.no_grad():
            one = model(ids, **cache_kwargs(model, full)).logits[:, 60:]
    assert torch.equal(logits[0], logits[1])
    assert (logits[0] - one).abs().max() > 1e-3  # the chunk did not see the history at full precision
    assert full.sequence_lengths() == cache.sequence_lengths() == [70]


@pytest.mark.slow
@pytest.mark.representative
def test_1500_tokens_with_small_windows():
    """Mechanics over many demotions: 1,500 generated tokens through 93 pages per layer, no error."""
    model = tiny_hf_model("qwen2")
    ids = torch.randint(1, 96, (1, 20))
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        cache = oscar.make_cache(1, 1520)
        tokens, scores = generate(model, ids, cache, max_new_tokens=1500, min_new_tokens=1500)
    assert tokens.shape == (1, 1500) and bool(torch.isfinite(scores).all())
    assert cache.sequence_lengths() == [1519]
    assert int(cache.layers[1].state.num_pages[0]) == SMALL_LAYOUT.pages_for(1519) == 93


@pytest.mark.slow
def test_compiled_backend_matches_eager():
    """backend="torch.compile" (compiled reference attention) gives the eager backend's tokens and scores."""
    model = tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 45))
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        eager = generate(model, ids, oscar.make_cache(1, 80), max_new_tokens=8)
    with enable_oscar(model, layout=SMALL_LAYOUT, backend="torch.compile") as oscar:
        assert oscar.ops.name == "torch.compile"
        compiled = generate(model, ids, oscar.make_cache(1, 80), max_new_tokens=8)
    assert_same_generation(compiled, eager, atol=1e-5)


# ---- bad input ------------------------------------------------------------------------------------------------


def test_unsupported_architectures_and_features_are_named():
    """The family table's one message, at enable_oscar time (never at the first forward); the model is untouched."""
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=96)).eval()
    with pytest.raises(NotImplementedError, match=r"'GPT2LMHeadModel' \(model_type 'gpt2'\) is not supported"):
        enable_oscar(gpt2)
    mistral = MistralForCausalLM(MistralConfig(**HF_MODEL)).eval()  # MistralConfig's default sliding_window is 4096
    with pytest.raises(NotImplementedError, match=r"'MistralForCausalLM' \(model_type 'mistral'\) has sliding-window "
                                                  r"attention in 2 of 2 layers \(0, 1; sliding_window=4096\)"):
        enable_oscar(mistral)
    sliding = Qwen2ForCausalLM(Qwen2Config(**HF_MODEL, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    with pytest.raises(NotImplementedError, match=r"in 1 of 2 layers \(1; sliding_window=8\); only full-attention"):
        enable_oscar(sliding)
    assert mistral.config._attn_implementation == sliding.config._attn_implementation == "sdpa"
    full = MistralForCausalLM(MistralConfig(**HF_MODEL, sliding_window=None)).eval()
    with enable_oscar(full) as oscar:
        s = oscar.shape
        assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (2, 4, 2, 16)
        assert oscar.shape.scaling == 16**-0.5 and oscar.shape.family.name == "Mistral"


def test_key_bits_without_an_artifact_give_layers_their_width():
    """``enable_oscar(model, key_bits=...)`` (no artifact: the benchmarks' mixed 2/4-bit caches): each layer's pages
    take its width, the bytes follow, and a wrong count or an artifact beside it is refused."""
    model = tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 50))
    with enable_oscar(model, layout=SMALL_LAYOUT, key_bits=(4, 2)) as oscar:
        cache = oscar.make_cache(1, 120)
        tokens, scores = generate(model, ids, cache, max_new_tokens=30)
    n = 50 + 30 - 1
    assert bool(torch.isfinite(scores).all())
    assert [layer.layout.key.bits for layer in cache.layers] == [4, 2]
    assert cache.kv_bytes() == SMALL_LAYOUT.with_key_bits(4).sequence_bytes(n) + SMALL_LAYOUT.sequence_bytes(n)
    with pytest.raises(ValueError, match=r"key_bits: expected one per layer \(2\), got 3"):
        enable_oscar(model, key_bits=(4, 2, 2))
    with pytest.raises(ValueError, match="layout, key_bits: the artifact defines them"):
        enable_oscar(model, artifact="some/dir", key_bits=(4, 2))


def test_bad_arguments_give_clear_errors():
    model = tiny_hf_model("llama")
    msg = r"backend: expected one of \['torch', 'torch.compile', 'triton'\], got 'cuda'"
    with pytest.raises(ValueError, match=msg):
        enable_oscar(model, backend="cuda")
    with pytest.raises(ValueError, match="layout: expected H_kv=2, D=16 .* got H_kv=3, D=16"):
        enable_oscar(model, layout=KVCacheLayout.default(3, 16))
    with pytest.raises(ValueError, match="artifact: expected a directory path or an OscarArtifact"):
        enable_oscar(model, artifact=42)
    assert model.config._attn_implementation == "sdpa"
    with enable_oscar(model) as oscar:
        ids = torch.randint(1, 96, (2, 10))
        with pytest.raises(ValueError, match=r"key_states: expected \[1, 2, T, 16\], got \[2, 2, 10, 16\]"):
            model(ids, **cache_kwargs(model, oscar.make_cache(1, 64)))
        with pytest.raises(TypeError, match="needs an OscarCache"):
            model(ids, **cache_kwargs(model, DynamicCache(config=model.config)))
        with pytest.raises(ValueError, match="batch_size and max_length: expected ints > 0"):
            oscar.make_cache(2, 0)
        # 5.24 asks the cache to repeat its batch (refused); 5.17 feeds 2 rows to a 1-row cache (refused)
        with pytest.raises((NotImplementedError, ValueError), match=r"fixed batch|expected \[1, 2, T, 16\]"):
            model.generate(ids[:1], num_return_sequences=2, do_sample=True, max_new_tokens=2,
                           **cache_kwargs(model, oscar.make_cache(1, 64)))


def test_triton_backend_is_registered():
    pytest.importorskip("triton")
    from oscar_export.plugins.hf import get_ops

    ops = get_ops("triton")
    assert ops.name == "triton" and ops.decode_attention.__module__.endswith("triton_backend")


def test_artifact_object_is_checked_and_used():
    model = tiny_hf_model("llama")
    transforms = [rotated_transform(2, 16, seed=i) for i in range(2)]
    calls = []
    art = SimpleNamespace(layout=SMALL_LAYOUT, transforms=transforms, check_model=calls.append)
    with enable_oscar(model, art) as oscar:
        assert calls == [model.config] and oscar.layout == SMALL_LAYOUT and oscar.transforms[1] is transforms[1]

    def mismatch(config):
        raise ValueError("artifact fingerprint: expected 30 layers, got 2")

    with pytest.raises(ValueError, match="fingerprint"):
        enable_oscar(model, SimpleNamespace(layout=SMALL_LAYOUT, transforms=transforms, check_model=mismatch))
    short = SimpleNamespace(layout=SMALL_LAYOUT, transforms=transforms[:1], check_model=calls.append)
    with pytest.raises(ValueError, match=r"transforms: expected 2 \(one per layer\), got 1"):
        enable_oscar(model, short)
    identity = [LayerTransform.identity(3, 16)] * 2
    with pytest.raises(ValueError, match="layout: expected H_kv=2"):
        enable_oscar(model, SimpleNamespace(layout=KVCacheLayout.default(3, 16), transforms=identity,
                                            check_model=calls.append))


def test_auto_backend_is_torch_on_cpu_and_triton_for_bf16_cuda():
    from oscar_export.plugins.hf.support import resolve_backend

    model = tiny_hf_model()
    assert resolve_backend(model, "auto") == "torch"  # fp32 on the CPU
    assert resolve_backend(model, "torch.compile") == "torch.compile"
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        assert resolve_backend(model.to("cuda", torch.bfloat16), "auto") == "triton"


def test_triton_backend_refuses_a_layout_its_kernels_cannot_run_at_enable_time():
    """Bug: a layout the decode kernel refuses (here groups of 32) passed ``enable_oscar(backend="triton")`` and
    failed only at the first decode step; now the decode kernel's layout check runs at enable time."""
    pytest.importorskip("triton")
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                           layer_types=["full_attention"] * 2)
    model = Gemma3ForCausalLM(cfg)
    from oscar_export.kernels.layout import RowFormat

    g32 = KVCacheLayout(2, 256, RowFormat(256, 32), RowFormat(256, 32), page_size=64)
    with pytest.raises(NotImplementedError, match=r"key group_size must equal head_dim \(256\) or be >= 64, got 32"):
        enable_oscar(model, backend="triton", layout=g32)
    for gran in ("token", "channel"):  # two groups of 128 per row: accepted
        with enable_oscar(model, backend="triton", key_granularity=gran) as oscar:
            assert (oscar.layout.key.group_size, oscar.layout.head_dim) == (128, 256)


def _mma(codebook=False):
    from oscar_export.kernels.layout import RowFormat

    return KVCacheLayout(2, 64, RowFormat(64, 64, "token", codebook=codebook, packing="mma16"),
                         RowFormat(64, 64, codebook=codebook, packing="mma16"), sink=16, window=64, page_size=64)


def test_packing_is_chosen_at_serve_time_and_an_artifact_packing_still_loads():
    """Issue 26: the page packing follows the decode backend ``select_backend`` picks, whatever the layout (or an
    old artifact) says: a BF16 model on the CPU gets linear pages (portable kernel, interpreted here, or the
    reference), and a layout written with mma16 pages is still accepted."""
    pytest.importorskip("triton")
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for backend, name in (("triton", "portable"), ("torch", "reference")):
        with enable_oscar(model, backend=backend, layout=_mma(), key_bits=(4, 2)) as oscar:
            assert [b.name for b in oscar.decode_backends] == [name, name]
            cache = oscar.make_cache(1, 256)
            assert [layer.layout.packing for layer in cache.layers] == ["linear", "linear"]
            assert [layer.layout.key.bits for layer in cache.layers] == [4, 2]
    with pytest.raises(NotImplementedError, match="GQA ratios"):
        from oscar_export.kernels.checks import check_hopper_layout

        check_hopper_layout(_mma(), 18)


def test_select_backend_table(monkeypatch):
    """``select_backend``: Hopper -> the Gluon kernel on mma16 pages for the formats it reads, another GPU or a
    format it does not read -> the portable kernel on linear pages, the CPU -> the reference; by sm arch too (what
    a bundle built without a GPU asks)."""
    pytest.importorskip("triton")
    from oscar_export.kernels.decode import hopper, select_backend

    lay = KVCacheLayout.default(2, 64, "channel")
    assert select_backend(lay, "cpu", 4).name == "reference"
    assert select_backend(lay, 80, 4).name == "portable" and "sm_80" in select_backend(lay, 80, 4).why
    if not hopper.HAVE_GLUON:
        assert select_backend(lay, 90, 4).name == "portable"
        return
    assert select_backend(lay, 90, 4).name == "hopper"
    assert select_backend(lay, 90, 4).layout(lay).packing == "mma16"
    assert select_backend(_mma(codebook=True), 90, 4).name == "portable"  # fitted levels: not in the Gluon kernel
    assert select_backend(lay, 90, 18).name == "portable"  # GQA 9
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert select_backend(lay, torch.device("cuda"), 4).name == "portable"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert select_backend(lay, torch.device("cuda"), 4).name == "hopper"
