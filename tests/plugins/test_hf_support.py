"""The HF path end to end through its entry point ``enable_oscar`` (plugins/hf/support.py): tiny random-weight
Llama / Qwen2 / Qwen3 models (mechanics, not accuracy), the arguments and models it refuses, the README's serving
loop under ``torch.compile``, a model without Triton, and the real SmolLM2-135M-Instruct (marked ``model``)."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pydoc_data.topics import topics
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

from oscar_export.bench import random_artifact
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf import CacheOps, OscarCache, cache_kwargs, enable_oscar, get_ops

from helpers import HF_MODEL, SMALL_LAYOUT, mma_layout, rotated_transform, tiny_hf_model, tiny_llama

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
    """Mechanics over many demotions: 1,500 generated tokens through 93 pages per layer, no error (the model's
    positions raised to 2,048: past ``max_position_embeddings`` a forward is refused)."""
    model = tiny_hf_model("qwen2")
    model.config.max_position_embeddings = 2048
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
    """A layout the decode kernel refuses (here groups of 32) is refused by ``enable_oscar(backend="triton")``, not at
    the first decode step."""
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


def test_packing_is_chosen_at_serve_time_and_an_artifact_packing_still_loads():
    """The page packing follows the decode backend ``select_backend`` picks, whatever the layout (or an
    old artifact) says: a BF16 model on the CPU gets linear pages (portable kernel, interpreted here, or the
    reference), and a layout written with mma16 pages is still accepted."""
    pytest.importorskip("triton")
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for backend, name in (("triton", "portable"), ("torch", "reference")):
        with enable_oscar(model, backend=backend, layout=mma_layout(), key_bits=(4, 2)) as oscar:
            assert [b.name for b in oscar.decode_backends] == [name, name]
            cache = oscar.make_cache(1, 256)
            assert [layer.layout.packing for layer in cache.layers] == ["linear", "linear"]
            assert [layer.layout.key.bits for layer in cache.layers] == [4, 2]
    with pytest.raises(NotImplementedError, match="GQA ratios"):
        from oscar_export.kernels.checks import check_hopper_layout

        check_hopper_layout(mma_layout(), 18)


# ---- the README's serving loop under torch.compile(fullgraph=True) on the CPU, and a model without Triton ----------
# ``step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` must trace every backend's
# decode step in one graph: nothing in it may read a pointer, a device value or a shape-dependent Python value (every
# check runs when the cache is made). On the CPU: the reference backend end to end, and the hopper backend's step
# traced by Dynamo (its kernels need an sm_90 GPU: tests/gpu/test_hf_gpu.py runs them).

LAYOUT = KVCacheLayout.default(2, 64, "channel", sink=16, window=64, page_size=64)


def _readme_loop(compiler: str, mode: str | None, steps: int) -> None:
    """Prefill two caches, then ``steps`` decode steps (crossing a demotion): compiled vs eager, same tokens. Keys
    rotated (a calibrated artifact's shape): the queries go through ``decode_append``'s rotation once a step."""
    model = tiny_llama()
    with torch.no_grad(), enable_oscar(model, random_artifact(model, seed=1, layout=LAYOUT, key_bits=(4, 2))) as oscar:
        assert oscar.ops.name == "torch"
        assert not any(layer.flags.keys_identity for layer in oscar.make_cache(1, 8).layers)
        eager, comp = oscar.make_cache(2, 400), oscar.make_cache(2, 400)
        ids = torch.randint(1, 96, (2, 150))
        tok = model(ids, **cache_kwargs(model, eager)).logits[:, -1:].argmax(-1)
        model(ids, **cache_kwargs(model, comp))
        step = torch.compile(model.forward, mode=mode, fullgraph=True, backend=compiler)
        pos = torch.full((2, 1), 150)
        for i in range(steps):
            got = step(tok, position_ids=pos, **cache_kwargs(model, comp)).logits
            want = model(tok, position_ids=pos, **cache_kwargs(model, eager)).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {i}: {m}")
            tok, pos = want[:, -1:].argmax(-1), pos + 1
        assert comp.sequence_lengths() == eager.sequence_lengths() == [150 + steps] * 2
        assert int(comp.layers[0].state.num_pages[0]) >= 1, "the steps crossed a demotion"


def test_readme_loop_fullgraph_on_cpu_reference():
    """The reference backend's decode step in one graph (Dynamo + AOT autograd, the custom-op-free reference ops),
    equal to eager over 30 steps that demote a page."""
    _readme_loop("aot_eager", None, 30)


@pytest.mark.slow
def test_readme_loop_inductor_reduce_overhead_on_cpu_reference():
    """The README's exact compile call (Inductor, ``mode="reduce-overhead"``) on the CPU reference backend
    (about 3 minutes of C++ compilation on a 2-core machine)."""
    _readme_loop("inductor", "reduce-overhead", 20)


class _Traced(Exception):
    pass


def _trace_only(gm, example_inputs):
    """A torch.compile backend that stops once Dynamo has traced the whole step: returns a callable that raises."""
    _trace_only.graphs.append(gm)

    def run(*args):
        raise _Traced

    return run


_trace_only.graphs = []


def traced_step(model, cache):
    """The FX graph Dynamo traces of one decode step of ``model`` on ``cache`` (``fullgraph=True``; nothing runs)."""
    _trace_only.graphs.clear()
    step = torch.compile(model.forward, fullgraph=True, backend=_trace_only)
    tok, pos = torch.ones(2, 1, dtype=torch.long), torch.full((2, 1), 150)
    with torch.no_grad(), pytest.raises(_Traced):
        step(tok, position_ids=pos, **cache_kwargs(model, cache))
    (gm,) = _trace_only.graphs
    return gm


def test_hopper_decode_step_traces_in_one_graph():
    """With mma16 pages the README loop traces: the hopper backend's checks (the Gluon wrapper's ``data_ptr() % 16``
    among them, which Dynamo cannot trace) run when the cache is made, and the step traced with ``fullgraph=True``
    holds the two custom ops per layer and nothing host-side; with rotated keys each layer's
    ``oscar.decode_attention`` reads the queries its ``oscar.decode_append`` returned (the rotation once a step).
    (Tracing only: the kernels need an sm_90 GPU.)"""
    pytest.importorskip("triton")
    from oscar_export.kernels.decode import DecodeBackend, hopper

    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    model = tiny_llama(dtype=torch.bfloat16)
    with enable_oscar(model, random_artifact(model, seed=1, layout=LAYOUT, key_bits=(2, 2)), backend="triton") as oscar:
        from dataclasses import replace

        on_hopper = replace(oscar, decode_backends=(DecodeBackend("hopper"),) * 2)
        cache = on_hopper.make_cache(2, 400)
        assert [layer.layout.packing for layer in cache.layers] == ["mma16", "mma16"]
        assert all(layer.decode_plan.hopper_kernel for layer in cache.layers)
        gm = traced_step(model, cache)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "oscar" in str(n.target)]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "decode" in str(n.target)]
    assert [str(n.target) for n in nodes] == ["oscar.decode_append", "oscar.decode_attention"] * 2, ops
    # the step's lengths, then the committed ones: written by one opaque op each (test below)
    assert ops[0] == "oscar.write_split" and ops.count("oscar.write_split") == 2, ops
    for append, attention in zip(nodes[::2], nodes[1::2]):
        assert attention.args[0] is append, f"{attention} reads {attention.args[0]}, not what {append} returned"


_NO_TRITON = textwrap.dedent("""
    import sys, importlib.abc

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Block())
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from oscar_export.kernels.decode import select_backend
    from oscar_export.kernels.layout import KVCacheLayout
    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    lay = KVCacheLayout.default(2, 64, "channel", sink=16, window=64, page_size=64)
    assert select_backend(lay, "cuda:0", 4).why == "Triton is not installed"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad(), enable_oscar(model, layout=lay) as oscar:
        assert oscar.ops.name == "torch", oscar.ops.name
        cache = oscar.make_cache(1, 300)
        out = model.generate(torch.randint(1, 96, (1, 120)), max_new_tokens=80, do_sample=False,
                             **cache_kwargs(model, cache))
    assert out.shape == (1, 200) and cache.sequence_lengths() == [199], cache.sequence_lengths()
    assert "triton" not in sys.modules
    print("ok")
""")


def test_a_model_without_triton_installed_generates():
    """A CPU model where Triton cannot be imported (an import blocker in a child process): ``enable_oscar`` picks
    the reference backend and ``generate`` runs past a demotion; nothing imports Triton."""
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]


def test_every_cache_tensor_the_step_reads_is_a_static_input():
    """CUDA-graph trees copy every graph input not marked static into the graph's buffers at each replay, so every
    tensor of the cache the traced step reads is marked (``torch._dynamo.mark_static_address``): the windows, pools
    and book, and also the layers' transform tensors and the plans' removal counts."""
    pytest.importorskip("triton")
    from dataclasses import fields

    model = tiny_llama(dtype=torch.bfloat16)
    with enable_oscar(model, random_artifact(model, seed=1, layout=LAYOUT, key_bits=(4, 2)), backend="triton") as oscar:
        cache = oscar.make_cache(2, 400)
        mine = {}
        for layer in cache.layers:
            owners = [(f"transform.{f.name}", getattr(layer.transform, f.name)) for f in fields(layer.transform)]
            owners += [(f"append_plan.{f.name}", getattr(layer.append_plan, f.name)) for f in fields(layer.append_plan)]
            owners += [(f"state.{f.name}", getattr(layer.state, f.name)) for f in fields(layer.state)]
            owners += [(f"step_state.{f.name}", getattr(layer.step_state, f.name)) for f in fields(layer.step_state)]
            mine.update({id(t): f"layer {layer.index} {name}" for name, t in owners if isinstance(t, torch.Tensor)})
        mine.update({id(t): "book" for t in cache.book.tensors() + [cache.seen]})
        inputs = []

        def keep_inputs(gm, example_inputs):
            inputs.extend(example_inputs)
            raise _Traced

        step = torch.compile(model.forward, fullgraph=True, backend=keep_inputs)
        with torch.no_grad(), pytest.raises(Exception, match="_Traced"):
            step(torch.ones(2, 1, dtype=torch.long), position_ids=torch.full((2, 1), 150), **cache_kwargs(model, cache))
    read = [(mine[id(t)], t) for t in inputs if isinstance(t, torch.Tensor) and id(t) in mine]
    assert len(read) > 20, [name for name, _ in read]
    loose = [name for name, t in read if getattr(t, "_dynamo_static_input_type", None) is None]
    assert not loose, f"{len(loose)} of {len(read)} cache tensors the step reads are not static: {loose[:8]}"


def test_the_step_lengths_are_one_op_in_the_compiled_graph():
    """``PageBook`` writes each set of the step's lengths with one opaque op, and the traced step writes none of the
    book's buffers with a ``copy_`` of its own (as plain tensor arithmetic, Inductor gives every attention launch
    that reads the lengths its own small kernel, and its fusion pass compares those kernels pairwise across the
    layers: compile time)."""
    model = tiny_llama(dtype=torch.bfloat16)
    with enable_oscar(model, random_artifact(model, seed=1, layout=LAYOUT, key_bits=(2, 2))) as oscar:
        gm = traced_step(model, oscar.make_cache(2, 400))
    splits = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == "oscar.write_split"]
    assert len(splits) == 2, gm.code
    copies = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "copy_"]
    assert not copies, [n.format_node() for n in copies]


# ---- the real SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, D 64), default layout (sink 64, recent 256,
# pages of 64) and no artifact (identity transforms, per-channel keys): marked ``model`` ------------------------------

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

    def write_planned(layer, state, plan, k_s, v_s):
        base.write_planned(layer, state, plan, k_s, v_s)
        scramble(state, state.block_table[plan.page_b, plan.page_n].tolist())

    def decode_append(layer, state, k, v, q, status):
        lay = layer.layout
        due = [b for b in range(k.shape[0]) if int(state.sink_len[b]) >= lay.sink
               and int(state.recent_len[b]) == lay.recent_capacity]
        pages = [int(state.block_table[b, int(state.num_pages[b])]) for b in due]
        q_s = base.decode_append(layer, state, k, v, q, status)
        scramble(state, [p for b, p in zip(due, pages) if int(status[b]) == 0])
        return q_s

    return CacheOps("noise", write_planned, decode_append, base.decode_attention, base.chunk_attention)


@pytest.mark.model
def test_inside_windows_identical_to_dynamic_cache(smollm2):
    model, tok = smollm2
    ids = prompt_ids(tok, "assert", 120)
    want = greedy(model, ids, DynamicCache(config=model.config), n=32)
    with enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 320)
        got = greedy(model, ids, cache, n=32)
    assert torch.equal(got, want), first_mismatch(got, want)
    assert int(cache.layers[0].state.num_pages[0]) == 0


@pytest.mark.model
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


@pytest.mark.model
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


@pytest.mark.model
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


@pytest.mark.model
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


@pytest.mark.model
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


# ---- the Python API refuses what it used to accept silently -------------------------------------------------------


def test_a_second_enable_oscar_on_an_enabled_model_is_refused():
    """``s1 = enable_oscar(m); s2 = enable_oscar(m); s1.restore(); s2.restore()`` left the model on "oscar"."""
    model = tiny_hf_model("llama")
    s1 = enable_oscar(model)
    with pytest.raises(ValueError, match="on the OSCAR attention already .* call restore\\(\\) on that setup first"):
        enable_oscar(model)
    s1.restore()
    assert model.config._attn_implementation == "sdpa"
    model(torch.randint(1, 96, (1, 5)))  # a plain forward works again
    with enable_oscar(model):
        pass
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("args", [(True, 10), (1, True), (1, False), (1.0, 10)])
def test_make_cache_refuses_bools_and_floats(args):
    model = tiny_hf_model("llama")
    with enable_oscar(model) as oscar:
        with pytest.raises(ValueError, match=r"batch_size and max_length: expected ints > 0"):
            oscar.make_cache(*args)


def test_position_ids_that_disagree_with_the_stored_length_are_refused():
    """Given position_ids must continue each slot's stored tokens (a prompt; a decode step on the CPU)."""
    model = tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 8))
    with torch.no_grad(), enable_oscar(model) as oscar:
        cache = oscar.make_cache(1, 64)
        kw = cache_kwargs(model, cache)
        model(ids, position_ids=torch.arange(8)[None], **kw)  # the right ones: accepted
        with pytest.raises(ValueError, match="position_ids: row 0 column 0 is 0, expected 8: that row's cache slot "
                                             "holds 8 tokens"):
            model(ids, position_ids=torch.arange(8)[None], **kw)
        with pytest.raises(ValueError, match="row 0 column 0 is 3, expected 8: .* holds 8 tokens"):
            model(ids[:, :1], position_ids=torch.tensor([[3]]), **kw)
        assert cache.sequence_lengths() == [8], "nothing was written by the refused forwards"
        model(ids[:, :1], position_ids=torch.tensor([[8]]), **kw)
        assert cache.sequence_lengths() == [9]


def test_a_cache_made_for_another_model_is_refused():
    a, b = tiny_hf_model("llama"), tiny_hf_model("llama")
    ids = torch.randint(1, 96, (1, 6))
    with torch.no_grad(), enable_oscar(a) as sa, enable_oscar(b) as sb:
        cache = sa.make_cache(1, 64)
        with pytest.raises(ValueError, match="cache: made by another model's enable_oscar setup"):
            b(ids, **cache_kwargs(b, cache))
        assert cache.sequence_lengths() == [0]
        b(ids, **cache_kwargs(b, sb.make_cache(1, 64)))
        a(ids, **cache_kwargs(a, cache))
        assert cache.sequence_lengths() == [6]


def test_a_prompt_past_max_position_embeddings_is_refused_and_a_longer_cache_warned():
    cfg = LlamaConfig(**{**HF_MODEL, "max_position_embeddings": 32})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad(), enable_oscar(model) as oscar:
        with pytest.warns(UserWarning, match="max_length 64 exceeds the model's max_position_embeddings 32"):
            cache = oscar.make_cache(1, 64)
        kw = cache_kwargs(model, cache)
        model(torch.randint(1, 96, (1, 30)), **kw)
        with pytest.raises(ValueError, match="reaches position 34, past the model's max_position_embeddings 32"):
            model(torch.randint(1, 96, (1, 4)), **kw)
        assert cache.sequence_lengths() == [30]
