"""The Hugging Face path on CUDA with the Triton backend (random weights of a real-ish shape: mechanics, not
accuracy): agreement with the reference ops, ragged batches, one CUDA graph per decode step, a 64K prompt,
NaN steps flagged on the device, ``generate`` with a compile config. Run on the H200."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oscar_export.bench import random_artifact
from oscar_export.kernels.pages import STATUS_NONFINITE
from oscar_export.plugins.hf import cache_kwargs, enable_oscar

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")


def model_of(layers=4, kv_heads=4, head_dim=64, heads=16, vocab=512, positions=8192, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2048,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=positions)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def agreement(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max relative logit error, top-1 agreement)`` of logits ``got`` against ``want`` (``[N, V]``)."""
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return rel, top1


def assert_triton_matches_torch(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Logits of the Triton backend ``got`` against the reference ops ``want`` over the same forced tokens: finite,
    max relative error < 2e-2 (both run a BF16 model; the attention arithmetic differs: fp16 dot operands vs fp32)
    and top-1 agreement >= 0.95."""
    assert torch.isfinite(got).all()
    rel, top1 = agreement(got, want)
    print(f"{what}, triton vs torch over {len(got)} steps: max relative logit error {rel:.2e}, top-1 {top1:.3f}")
    assert rel < 2e-2, rel
    assert top1 >= 0.95, top1


def artifact_of(model, kind: str):
    """None (identity transforms) or ``"rotated"``: ``oscar_export.bench.random_artifact`` (rotated and scaled keys,
    means, channel keys, 4-bit keys in every other layer)."""
    return None if kind == "identity" else random_artifact(model)


def forced_logits(model, setup, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill ``prompt [1, T]`` then feed ``tokens [N]`` one by one; logits of every step ``[N + 1, V]`` fp32."""
    cache = setup.make_cache(1, prompt.shape[1] + tokens.numel() + 1)
    out = [model(prompt, use_cache=True, **cache_kwargs(model, cache)).logits[0, -1].float()]
    for t in tokens.tolist():
        ids = torch.tensor([[t]], device=prompt.device)
        out.append(model(ids, use_cache=True, **cache_kwargs(model, cache)).logits[0, -1].float())
    return torch.stack(out)


def triton_against_reference(model, what: str, on_triton=lambda setup: setup, **enable) -> None:
    """``enable_oscar(model, **enable)`` with the Triton backend (``on_triton(setup)``: checks it, returns the setup
    to run) against the reference ops over the same forced tokens (:func:`assert_triton_matches_torch`): a 700-token
    prompt (> 64 + 256 + 64: INT2 pages from the prompt), then 130 tokens (two demotions during decode)."""
    prompt = torch.randint(0, 512, (1, 700), device="cuda")
    tokens = torch.randint(0, 512, (130,), device="cuda")
    with enable_oscar(model, **enable) as setup:
        assert setup.ops.name == "triton"
        got = forced_logits(model, on_triton(setup), prompt, tokens)
    with enable_oscar(model, backend="torch", **enable) as setup:
        want = forced_logits(model, setup, prompt, tokens)
    assert_triton_matches_torch(got, want, what)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["identity", "rotated"])
def test_auto_backend_is_triton_and_matches_reference_ops(kind):
    """The Triton backend against the reference ops; with rotated keys (``"rotated"``) the queries are rotated once
    a step by the append launch and the decode kernels read them as they are."""
    model = model_of()

    def check(setup):
        cache = setup.make_cache(1, 8)
        assert all(layer.flags.keys_identity == (kind == "identity") for layer in cache.layers)
        assert all(layer.append_plan.rotate_q == (kind == "rotated") for layer in cache.layers)
        return setup

    triton_against_reference(model, f"{kind} keys", check, artifact=artifact_of(model, kind))


@torch.no_grad()
@pytest.mark.parametrize("gran", ["token", "channel"])
def test_mixed_key_bits_triton_matches_reference_ops(gran):
    """An artifact with 4-bit keys in layers 0 and 2 (2-bit in 1 and 3) through the Triton backend
    (each layer's kernels launched with its own layout) agrees with the reference ops as the 2-bit path does."""
    from dataclasses import replace

    from oscar_export.calibration.artifact import OscarArtifact, model_fingerprint
    from oscar_export.kernels.layout import KVCacheLayout
    from oscar_export.kernels.transform import LayerTransform

    model = model_of()
    lay = KVCacheLayout.default(4, 64, gran)
    ts = [LayerTransform.identity(4, 64, 0.96, 0.92) for _ in range(4)]
    ts = [replace(t, k_clip=torch.ones(4)) if i % 2 == 0 else t for i, t in enumerate(ts)]
    art = OscarArtifact(lay, tuple(ts), model_fingerprint(model.config), key_bits=(4, 2, 4, 2))
    triton_against_reference(model, f"mixed key bits ({gran})", artifact=art)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["hopper", "portable"])
def test_each_decode_backend_matches_reference_ops(backend):
    """Each Triton decode backend (its packing written by the prefill and the decode-step demotions, its
    kernel reading them) agrees with the reference ops; the layout's own packing (mma16 here) does not matter."""
    from dataclasses import replace

    from oscar_export.kernels.decode import DecodeBackend
    from oscar_export.kernels.layout import KVCacheLayout

    if backend == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper backend runs on sm_90")
    model = model_of(kv_heads=4, head_dim=64)
    lay = KVCacheLayout.default(4, 64, "channel", packing="mma16", page_size=64)
    triton_against_reference(model, f"{backend} backend",
                             lambda setup: replace(setup, decode_backends=(DecodeBackend(backend),) * 4), layout=lay)


def test_select_backend_on_this_gpu_with_the_plans_split():
    """On the H200 ``enable_oscar`` picks the hopper backend (mma16 pages) for 2-bit key layers and each
    layer splits its pages by the launch plan's wave rule; the 4-bit key layers get what ``select_backend`` says."""
    from oscar_export.kernels.aot.launch_plan import gl_pages_per_split
    from oscar_export.kernels.decode import select_backend
    from oscar_export.kernels.layout import KVCacheLayout

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper backend is chosen on sm_90 only")
    model = model_of(kv_heads=4, head_dim=64)
    lay = KVCacheLayout.default(4, 64, "channel", page_size=64)
    with enable_oscar(model, layout=lay, key_bits=(2, 4, 2, 4)) as setup:
        k4 = select_backend(lay.with_key_bits(4), torch.device("cuda"), 16).name
        assert [b.name for b in setup.decode_backends] == ["hopper", k4, "hopper", k4]
        cache = setup.make_cache(2, 8192)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        want = gl_pages_per_split(2, 4, cache.book.max_pages, sms, 64)
        assert [layer.layout.packing for layer in cache.layers[::2]] == ["mma16"] * 2
        assert [layer.decode_plan.pages_per_split for layer in cache.layers[::2]] == [want] * 2
        print(f"on {torch.cuda.get_device_name()}: 2-bit key layers hopper, {want} pages a split "
              f"({cache.book.max_pages} pages); 4-bit key layers {k4}")


@torch.no_grad()
def test_ragged_batch_of_4_with_max_length_8192():
    """Four left-padded prompts (ragged), max_length 8192, Triton backend: each row decodes what it decodes alone
    (teacher-forced logits), through demotions. Batch >= 2 used to fail with a non-contiguous block table."""
    model = model_of(kv_heads=8, head_dim=128, heads=16)
    lens = [700, 1500, 90, 1100]
    n, steps = max(lens), 80
    prompts = [torch.randint(1, 512, (t,), device="cuda") for t in lens]
    ids = torch.zeros(4, n, dtype=torch.long, device="cuda")
    mask = torch.zeros(4, n, dtype=torch.long, device="cuda")
    for b, p in enumerate(prompts):
        ids[b, n - len(p):] = p
        mask[b, n - len(p):] = 1
    feed = torch.randint(1, 512, (4, steps), device="cuda")
    with enable_oscar(model) as setup:
        assert setup.ops.name == "triton"
        cache = setup.make_cache(4, 8192)
        kw = cache_kwargs(model, cache)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(ids, attention_mask=mask, position_ids=pos, logits_to_keep=1, **kw)
        batch = [out.logits[:, -1].float()]
        p = torch.tensor(lens, device="cuda")[:, None]
        for t in range(steps - 1):
            batch.append(model(feed[:, t : t + 1], position_ids=p + t, **kw).logits[:, -1].float())
        assert cache.sequence_lengths() == [t + steps - 1 for t in lens]
        for b, prm in enumerate(prompts):
            alone = setup.make_cache(1, 8192)
            ka = cache_kwargs(model, alone)
            seq = [model(prm[None], logits_to_keep=1, **ka).logits[0, -1].float()]
            for t in range(steps - 1):
                seq.append(model(feed[b : b + 1, t : t + 1], **ka).logits[0, -1].float())
            got, want = torch.stack([x[b] for x in batch]), torch.stack(seq)
            rel, top1 = agreement(got, want)
            print(f"row {b} ({lens[b]} tokens): max relative logit error {rel:.2e}, top-1 agreement {top1:.3f}")
            assert rel < 3e-2 and top1 >= 0.9, (b, rel, top1)


def _prefilled(model, setup, b, prompt_len, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(1, 512, (b, prompt_len), device="cuda", generator=g)
    cache = setup.make_cache(b, prompt_len + 200)
    out = model(ids, logits_to_keep=1, **cache_kwargs(model, cache))
    return cache, out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def _static_cache_compile_error(model, b, prompt_len, steps):
    """Max relative logit error of the README loop's compiled step against the eager forward, BF16 ``StaticCache``,
    each step from the same cache state (the compiled cache's tensors copied into the eager one)."""
    from transformers import StaticCache

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, 512, (b, prompt_len), device="cuda", generator=g)
    comp, ref = (StaticCache(config=model.config, max_cache_len=prompt_len + steps + 8) for _ in range(2))
    for c in (comp, ref):
        tok = model(ids, logits_to_keep=1, past_key_values=c).logits[:, -1:].argmax(-1)
    f = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    pos, worst = torch.full((b, 1), prompt_len, device="cuda"), 0.0
    for _ in range(steps):
        for mine, theirs in zip(ref.layers, comp.layers):
            for name, t in vars(theirs).items():
                if isinstance(t, torch.Tensor):
                    getattr(mine, name).copy_(t)
        got = f(tok, position_ids=pos, past_key_values=comp).logits.float()
        want = model(tok, position_ids=pos, past_key_values=ref).logits.float()
        worst = max(worst, ((got - want).norm() / want.norm()).item())
        tok, pos = got[:, -1:].argmax(-1), pos + 1
    torch._dynamo.reset()
    return worst


@torch.no_grad()
def test_decode_step_in_one_cuda_graph_equals_eager():
    """The whole model's decode step (all layers; rotated keys: the queries rotated by the append launch) captured by
    torch.cuda.graph replays bit for bit like eager, over a demotion (torch.compile: the README-loop test below)."""
    model = model_of(kv_heads=8, head_dim=128, heads=16)
    with enable_oscar(model, artifact_of(model, "rotated")) as setup:
        eager, tok = _prefilled(model, setup, 2, 1060, 0)
        graphed, _ = _prefilled(model, setup, 2, 1060, 0)
        pos = torch.full((2, 1), 1060, device="cuda")
        ids, pos_in = tok.clone(), pos.clone()
        kw = cache_kwargs(model, graphed)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on a third cache (kernels compiled, nothing of `graphed` touched)
            warm, _ = _prefilled(model, setup, 2, 1060, 1)
            model(ids, position_ids=pos_in, **cache_kwargs(model, warm))
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        snap = [t.clone() for t in graphed.book.tensors()] + [graphed.seen.clone()]
        with torch.cuda.graph(g):
            static_logits = model(ids, position_ids=pos_in, **kw).logits
        for t, c in zip(graphed.book.tensors() + [graphed.seen], snap):  # capture does not run; be explicit
            t.copy_(c)
        for i in range(80):  # 1060 + 80 crosses a demotion (at 1089)
            ids.copy_(tok)
            pos_in.copy_(pos)
            g.replay()
            want = model(tok, position_ids=pos, **cache_kwargs(model, eager)).logits
            assert torch.equal(static_logits, want), f"step {i}: graph replay differs from eager"
            tok, pos = want[:, -1:].argmax(-1), pos + 1
        assert graphed.sequence_lengths() == eager.sequence_lengths() == [1140, 1140]
        assert int(eager.layers[0].state.num_pages[0]) == setup.layout.pages_for(1140) > setup.layout.pages_for(1060)


@torch.no_grad()
def test_64k_prompt_prefills_and_decodes():
    """A 65,536-token prompt through SDPA (no [T, T] tensor) and the quantize kernels, then decode steps."""
    model = model_of(layers=2, kv_heads=8, head_dim=128, heads=32, positions=131072)
    with enable_oscar(model) as setup:
        cache = setup.make_cache(1, 65536 + 8)
        ids = torch.randint(1, 512, (1, 65536), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = model(ids, logits_to_keep=1, **cache_kwargs(model, cache))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        print(f"64K prompt: prefill peak {peak:.2f} GiB above the model and cache")
        assert cache.sequence_lengths() == [65536 + 4]
        assert cache.step_status().tolist() == [0]
        assert peak < 8, peak  # [T, T] fp32 scores of one head alone would be 16 GiB


@torch.no_grad()
def test_nan_token_is_flagged_on_the_device_and_not_stored():
    model = model_of()
    with enable_oscar(model) as setup:
        cache, _ = _prefilled(model, setup, 2, 500, 3)
        before = [cache.layers[-1].read_sequence(b) for b in range(2)]
        model.model.embed_tokens.weight[7] = float("nan")
        model(torch.tensor([[7], [9]], device="cuda"), position_ids=torch.full((2, 1), 500, device="cuda"),
              **cache_kwargs(model, cache))
        assert cache.step_status().tolist() == [STATUS_NONFINITE, 0]
        assert cache.sequence_lengths() == [500, 501]
        for x, y in zip(cache.layers[-1].read_sequence(0), before[0]):
            assert torch.equal(x, y)


@torch.no_grad()
def test_generate_with_a_compile_config():
    """transformers' own compiled path: ``generate(..., past_key_values=cache)`` with a ``compile_config``, rotated
    keys (a calibrated artifact's shape)."""
    from transformers import CompileConfig, GenerationConfig

    model = model_of()
    ids = torch.randint(1, 512, (1, 600), device="cuda")
    with enable_oscar(model, artifact_of(model, "rotated")) as setup:
        eager = model.generate(ids, max_new_tokens=24, do_sample=False, **cache_kwargs(model, setup.make_cache(1, 700)))
        cfg = GenerationConfig(max_new_tokens=24, do_sample=False,
                               compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
        cache = setup.make_cache(1, 700)
        got = model.generate(ids, generation_config=cfg, **cache_kwargs(model, cache))
    agree = (got[0, 600:] == eager[0, 600:]).float().mean().item()
    print(f"generate with compile_config vs eager: {agree:.2f} of 24 greedy tokens agree")
    assert got.shape == eager.shape and cache.sequence_lengths() == [600 + 23]
    assert torch.equal(got[0, 600:604], eager[0, 600:604])


@torch.no_grad()
def test_readme_loop_with_a_calibrated_shape_artifact():
    """The README loop (``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``) with an
    artifact of a calibrated model's shape (rotated and scaled keys, means, channel keys, 4-bit keys in half the
    layers: ``oscar_export.bench.random_artifact``) on the backends ``select_backend`` picks, against the eager
    forward over steps that cross a demotion.

    Each step starts both caches from the same state (the compiled cache's, copied into the eager one), so the
    comparison measures one step's compiled-vs-eager arithmetic, not a drift: Inductor rounds the dense BF16 parts
    differently from eager, and over steps the caches would hold (and demote) slightly different keys (the first
    run of this test, comparing two caches that drifted apart, saw 2.02e-2 after 70 steps, 67/70 same tokens; from the
    same cache 1.93e-2 and 64/70 on the H200 at aaf0a40: the greedy tokens of random weights flip at near ties, so they
    are printed, not asserted; ``test_generate_with_a_compile_config`` asserts tokens).

    The bound is BF16's own: the same model with transformers' ``StaticCache``, compiled vs eager from the same
    cache state over the same steps, is the error of compiling the dense parts; OSCAR's compiled step reads the same
    custom-op kernels as its eager step, so its error must stay within twice that, plus 1e-3."""
    model = model_of(kv_heads=8, head_dim=128, heads=32)
    bf16_worst = _static_cache_compile_error(model, 2, 1060, 70)
    art = artifact_of(model, "rotated")
    with enable_oscar(model, art) as setup:
        print("backends:", [b.name for b in setup.decode_backends])
        comp, tok = _prefilled(model, setup, 2, 1060, 0)
        ref, _ = _prefilled(model, setup, 2, 1060, 0)
        f = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        pos = torch.full((2, 1), 1060, device="cuda")
        worst, same = 0.0, 0
        for i in range(70):  # 1060 + 70 crosses a demotion (at 1089)
            for mine, theirs in zip(ref.static_tensors(), comp.static_tensors()):
                mine.copy_(theirs)
            got = f(tok, position_ids=pos, **cache_kwargs(model, comp)).logits.float()
            want = model(tok, position_ids=pos, **cache_kwargs(model, ref)).logits.float()
            worst = max(worst, ((got - want).norm() / want.norm()).item())
            same += int(torch.equal(got.argmax(-1), want.argmax(-1)))
            tok, pos = got[:, -1:].argmax(-1), pos + 1
        print(f"README loop vs eager from the same cache, calibrated-shape artifact, 70 steps: max relative logit "
              f"error {worst:.2e}, {same}/70 steps with the same greedy tokens; BF16 StaticCache compiled vs eager: "
              f"{bf16_worst:.2e}")
        assert comp.sequence_lengths() == ref.sequence_lengths() == [1130, 1130]
        assert int(comp.layers[0].state.num_pages[0]) == setup.layout.pages_for(1130) > setup.layout.pages_for(1060)
        assert bool((comp.step_status() == 0).all())
        assert worst <= 2 * bf16_worst + 1e-3  # greedy agreement printed: random weights' logits are near ties
