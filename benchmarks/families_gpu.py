"""Gemma-3- and Qwen3-MoE-shaped random-weight models through the Hugging Face path, end to end (mechanics, speed).

    python benchmarks/families_gpu.py OUTDIR                      # on the H200: BF16, the triton backend
    python benchmarks/families_gpu.py OUTDIR --device cpu --tiny  # a CPU smoke run (fp32, torch backend, small)

For each model (few layers, the real attention shapes, random weights; accuracy claims need real weights):

1. calibrate on random tokens (mechanics only: the statistics of random weights mean nothing), keys per
   channel (the default; ``--key-granularity token`` for per-token keys); a failed calibration falls back to
   the identity artifact and is reported;
2. ``enable_oscar(model, artifact)`` with the fast path (``OscarCache`` + the triton backend on CUDA);
3. inside the windows (prompt + new tokens < S0 + W + P, so no INT2 page exists yet) greedy generation is
   compared token for token with ``DynamicCache`` (reported, not asserted: in BF16 the kernels' fp16/fp32
   arithmetic differs from SDPA's, and a random-weight model's near-flat logits can flip a greedy token);
   ``gemma3-12b-w128`` shrinks the sliding window to 128 so the sliding ring wraps inside that run (it skips 4.);
4. a long prompt (``--context``) then ``--steps`` decode steps: median step time (eager, CUDA-synchronised),
   the cache's memory split (OSCAR layers, sliding layers, book) next to what a BF16 ``DynamicCache`` holds.

Every part runs under try/except: a failure is printed and recorded in the JSON, and the rest still runs.
Writes ``OUTDIR/families_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

VOCAB = 32000


def configs(tiny: bool) -> dict:
    """Few-layer configs with the real head shapes (``tiny``: small widths for a CPU smoke run)."""
    if tiny:
        gemma = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256, sliding_window=64,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        moe = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=128, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32)
    else:  # Gemma-3-12B: 16 query / 8 KV heads of 256, 5 local : 1 global; Qwen3-30B-A3B: 32 / 4 of 128
        gemma = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=6, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                     layer_types=["sliding_attention"] * 5 + ["full_attention"])
        moe = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=32,
                   num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                   moe_intermediate_size=768)
    common = dict(vocab_size=VOCAB if not tiny else 96, max_position_embeddings=40960, eos_token_id=None)
    w128 = dict(gemma, sliding_window=min(128, gemma["sliding_window"]))
    return {
        "gemma3-12b": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**common, **gemma}),
        "gemma3-12b-w128": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**common, **w128}),
        "qwen3-moe-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**common, **moe}),
    }


class RandomTokenizer:
    """Bytes as token ids: the calibration data path needs a tokenizer, random weights need no vocabulary."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        return {"input_ids": torch.tensor([[b % self.vocab for b in text.encode()]])}


def build(kind: tuple, device: str, dtype: torch.dtype):
    cfg_cls, model_cls, kw = kind
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**kw, architectures=[model_cls])
    with torch.device(device):
        model = getattr(transformers, model_cls)(cfg)
    return model.to(dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def part(result: dict, name: str, fn):
    """Run ``fn()``; record its value (or the error) under ``result[name]`` and print a line either way."""
    t0 = time.perf_counter()
    try:
        value = fn()
        result[name] = value
        shown = json.dumps(value, default=str)[:600] if isinstance(value, dict) else type(value).__name__
        print(f"  [{name}] ok in {time.perf_counter() - t0:.1f}s: {shown}", flush=True)
        return value
    except Exception as e:  # keep going: one failure must not lose the other parts
        result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"  [{name}] FAILED after {time.perf_counter() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=6)
        return None


def calibrate_quickly(model, tiny: bool, key_granularity: str):
    from oscar_export.calibration.pipeline import CalibrationConfig, calibrate

    seq = 512 if not tiny else 448
    cfg = CalibrationConfig(tokens=4 * seq, seq_len=seq, heldout=1, batch_size=1, key_granularity=key_granularity)
    t0 = time.perf_counter()
    art = calibrate(model, RandomTokenizer(model.config.vocab_size), cfg)
    return art, time.perf_counter() - t0


def greedy(model, ids, cache, n):
    from oscar_export.plugins.hf import cache_kwargs

    out = model.generate(ids, max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, **cache_kwargs(model, cache))
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.scores, 1).float()


def compare_inside_windows(model, oscar, device: str, prompt: int, new: int) -> dict:
    lay = oscar.layout
    if prompt + new >= lay.sink + lay.recent_capacity:
        raise ValueError(f"prompt {prompt} + {new} leaves the windows ({lay.sink} + {lay.recent_capacity})")
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), device=device)
    cache = oscar.make_cache(1, prompt + new + 8)
    got, got_scores = greedy(model, ids, cache, new)
    oscar.restore()
    try:
        want, want_scores = greedy(model, ids, DynamicCache(config=model.config), new)
    finally:
        model.set_attn_implementation("oscar")
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    steps = min(same if same is not None else new, got_scores.shape[1], want_scores.shape[1])
    diff = (got_scores[:, :steps] - want_scores[:, :steps]).abs().max().item() if steps else 0.0
    sliding = [la for la in cache.sliding_layers]
    return {"prompt": prompt, "new_tokens": new, "tokens_equal": got == want,
            "first_different_step": same, "max_logit_diff_before_divergence": diff,
            "sliding_window": sliding[0].window if sliding else None,
            "sliding_ring_wrapped": bool(sliding) and prompt + new > sliding[0].window,
            "oscar_int2_pages": [int(la.state.num_pages[0]) for la in cache.oscar_layers]}


def dynamic_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def long_context(model, oscar, device: str, context: int, steps: int) -> dict:
    """Prefill ``context`` random tokens, then time ``steps`` decode steps; memory of the OSCAR cache by part and
    of a BF16 ``DynamicCache`` holding the same tokens."""
    from oscar_export.plugins.hf import cache_kwargs

    ids = torch.randint(1, model.config.vocab_size, (1, context), device=device)
    cache = oscar.make_cache(1, context + steps + 1)
    out = {}
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        logits = model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits
        sync(device)
        out["prefill_s"] = time.perf_counter() - t0
        tok = logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            logits = model(tok, use_cache=True, **cache_kwargs(model, cache)).logits
            sync(device)
            times.append(time.perf_counter() - t0)
            tok = logits[:, -1:].argmax(-1)
    out["decode_step_ms_median"] = 1e3 * statistics.median(times)
    out["decode_step_ms_min"] = 1e3 * min(times)
    out["finite"] = bool(torch.isfinite(logits).all())
    out["step_status_ok"] = int(cache.step_status().abs().sum()) == 0
    out["memory"] = cache.memory()
    out["allocated_bytes"] = cache.allocated_bytes()
    out["bf16_bytes_same_tokens"] = cache.bf16_bytes()
    out["sequence_length"] = cache.sequence_lengths()[0]
    out["oscar_int2_pages"] = [int(la.state.num_pages[0]) for la in cache.oscar_layers]
    del cache
    oscar.restore()
    try:  # the BF16 baseline: what DynamicCache holds for the same prompt (every layer, every token)
        ref = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, ref))
        out["dynamic_cache_bytes"] = dynamic_bytes(ref)
        del ref
    finally:
        model.set_attn_implementation("oscar")
    return out


def run_model(name: str, kind: tuple, args) -> dict:
    from oscar_export.calibration.artifact import OscarArtifact
    from oscar_export.calibration.families import family_for
    from oscar_export.plugins.hf import enable_oscar

    print(f"=== {name}", flush=True)
    res: dict = {"model": name}
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = part(res, "build", lambda: build(kind, args.device, dtype))
    if model is None:
        return res
    f = family_for(model)
    res["shape"] = {"layers": f.num_layers, "heads": f.num_heads, "kv_heads": f.num_kv_heads, "head_dim": f.head_dim,
                    "sliding_layers": list(f.sliding_layers), "sliding_window": f.sliding_window,
                    "scaling": f.scaling}
    cal = part(res, "calibrate", lambda: calibrate_quickly(model, args.tiny, args.key_granularity))
    if cal is not None:
        art, seconds = cal
        res["calibrate"] = {"seconds": round(seconds, 1), "layout": art.layout.to_dict()}
    else:
        from oscar_export.kernels.layout import KVCacheLayout

        art = OscarArtifact.identity(model, KVCacheLayout.default(f.num_kv_heads, f.head_dim, args.key_granularity))
        res["artifact"] = "identity (calibration failed)"
    backend = "triton" if args.device == "cuda" else "torch"
    res["backend"] = backend
    oscar = part(res, "enable_oscar", lambda: enable_oscar(model, art, backend=backend))
    if oscar is None:
        return res
    res["enable_oscar"] = {"layout": oscar.layout.to_dict()}
    prompt = 300 if "w128" in name else 200
    part(res, "inside_windows_vs_dynamic_cache", lambda: compare_inside_windows(model, oscar, args.device, prompt,
                                                                                args.new_tokens))
    if "w128" in name:  # the same model as gemma3-12b with a shorter window: its long run adds nothing
        pass
    elif not args.tiny or args.device == "cuda":
        part(res, "long_context", lambda: long_context(model, oscar, args.device, args.context, args.steps))
    else:
        part(res, "long_context", lambda: long_context(model, oscar, args.device, 600, 3))
    oscar.restore()
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="example: python benchmarks/families_gpu.py $OUT/families")
    ap.add_argument("outdir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small widths (a CPU smoke run)")
    ap.add_argument("--models", default=None, help="comma list (default: all)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--key-granularity", default="channel", choices=("channel", "token"))
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "git": sha or "?",
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(env), flush=True)
    models = configs(args.tiny)
    names = args.models.split(",") if args.models else list(models)
    results = []
    for name in names:
        try:
            results.append(run_model(name, models[name], args))
        except Exception as e:  # a crash outside the parts: record and continue
            traceback.print_exc()
            results.append({"model": name, "error": f"{type(e).__name__}: {e}"})
        (out / "families_gpu.json").write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))
    print("\n=== summary")
    for r in results:
        inside = r.get("inside_windows_vs_dynamic_cache", {})
        lc = r.get("long_context", {})
        mem = lc.get("memory", {}) if isinstance(lc, dict) else {}
        print(f"{r['model']:>20}: inside windows tokens_equal={inside.get('tokens_equal', inside.get('error'))} "
              f"(first diff {inside.get('first_different_step')}); "
              f"step {lc.get('decode_step_ms_median', float('nan')):.2f} ms at {lc.get('sequence_length')} tokens; "
              f"OSCAR {mem.get('oscar_allocated', 0) / 2**20:.1f} MiB + sliding {mem.get('sliding_allocated', 0) / 2**20:.1f}"
              f" MiB allocated (held: {mem.get('oscar_kv', 0) / 2**20:.1f} + {mem.get('sliding_kv', 0) / 2**20:.1f} MiB) "
              f"vs DynamicCache {lc.get('dynamic_cache_bytes', 0) / 2**20:.1f} MiB"
              + (f"; errors: {[k for k, v in r.items() if isinstance(v, dict) and 'error' in v]}" if any(
                  isinstance(v, dict) and "error" in v for v in r.values()) else ""))
    failed = [r["model"] for r in results
              if "error" in r or any(isinstance(v, dict) and "error" in v for v in r.values())]
    print(f"wrote {out / 'families_gpu.json'}; parts failed in: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
