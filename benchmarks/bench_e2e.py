"""End to end on the GPU: a whole decode step and a whole prefill of an 8B-shaped model, OSCAR vs BF16.

    python benchmarks/bench_e2e.py [--model llama3-8b|qwen3-8b] [--workloads 1x8192,1x32768]
        [--equal-kv-gib 64 --equal-context 32768] [--json out.json] [--commit SHA]

Random BF16 weights (speed does not depend on them). Per workload ``B x L`` and per cache, in one process:

* ``oscar``: ``enable_oscar(model)`` (Triton backend), ``make_cache(B, L + steps)``; the prompt is prefilled
  in one forward (SDPA in BF16, then the quantize kernels), the decode step runs under
  ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (one CUDA graph per step).
* ``oscar-graph``: the same cache, its eager forward captured once with ``torch.cuda.graph`` (no compiler;
  the rest of the model runs unfused eager kernels inside the graph).
* ``bf16-static``: transformers' ``StaticCache`` with the same compile mode (what a speed-minded user runs);
  prefilled in 8K chunks (its masked attention over the static cache).
* ``bf16-dynamic``: eager ``DynamicCache`` decode (filled without a prefill: contents do not change its speed).
* ``oscar-k4`` / ``oscar-graph-k4``: as ``oscar`` / ``oscar-graph`` with 4-bit keys in the layers ``--k4-layers``
  names (issue 17's mixed format; 2-bit elsewhere).
* ``oscar-v2`` / ``oscar-graph-v2`` and ``oscar-v3`` / ``oscar-graph-v3``: the same cache bytes in ``mma16`` pages,
  decoded by the v2 "fields" kernel or by v3, the Gluon kernel (``enable_oscar(layout=..., decode_variant=...)``;
  issue 11); ``-v3fm`` / ``-v3sm``: v3 with the merge fused into its split kernel or launched on its own.

``--no-prefill`` rows (and the equal-memory rows) set the cache lengths directly instead of prefilling: decode
speed does not depend on the values stored. Decode times are medians of CUDA-event timings of single steps.
Roofline: (weight bytes + the cache bytes a step must read, from the layout) / the copy bandwidth measured in
the same run. Peak memory is ``torch.cuda.max_memory_allocated`` over the row's prefill and decode.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import time

import torch

MODELS = {
    "llama3-8b": dict(kind="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144),
    "qwen3-8b": dict(kind="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144),
}
PREFILL_CHUNK = 8192


def env_line(commit: str | None) -> str:
    import transformers
    import triton

    sha = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
            f"transformers {transformers.__version__} | git {sha or '?'} | {time.strftime('%Y-%m-%d')}")


def build(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    spec = dict(MODELS[name])
    kind = spec.pop("kind")
    cfg = (LlamaConfig if kind == "llama" else Qwen3Config)(**spec)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = (LlamaForCausalLM if kind == "llama" else Qwen3ForCausalLM)(cfg)
    torch.set_default_dtype(prev)
    return model.eval()


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write of a 4 GiB buffer, median of 10)."""
    x = torch.empty(2**31, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * 2**32 / statistics.median(times[2:])


def kw(model, cache) -> dict:
    from oscar_export.plugins.hf import cache_kwargs

    return cache_kwargs(model, cache)


def time_steps(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def launch_split(step, n: int) -> dict:
    """Where a synchronised step's time goes: ``host_ms``, the median host time of one ``step()`` call (a graph
    launch, or the eager / compiled forward's Python), and ``pipelined_ms``, the GPU time per step of ``n`` steps
    launched back to back (the host running ahead: what the step costs when the launch is hidden)."""
    host = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        step()
    b.record()
    b.synchronize()
    return {"host_ms": statistics.median(host), "pipelined_ms": a.elapsed_time(b) / n}


def profile_step(step) -> dict:
    """Kernels of one step (a graph replay counts each kernel in it): count and GPU time by kernel."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by = {}
    for e in kernels:
        n, t = by.get(e.name, (0, 0.0))
        by[e.name] = (n + 1, t + e.device_time_total)
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:8]
    # idle GPU time between consecutive kernels, charged to the kernel that waited to start (a graph replay's gaps
    # are launch latency and whatever the device waits on; the host is not in the loop)
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    gaps, end = {}, spans[0][1] if spans else 0.0
    for start, stop, name in spans[1:]:
        if start > end:
            n, t = gaps.get(name, (0, 0.0))
            gaps[name] = (n + 1, t + start - end)
        end = max(end, stop)
    top_gaps = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:6]
    return {"kernels": len(kernels), "gpu_ms": sum(t for _, (_, t) in by.items()) / 1e3,
            "top": [(name[:60], n, round(t / 1e3, 3)) for name, (n, t) in top],
            "idle_ms": round(sum(t for _, t in gaps.values()) / 1e3, 3),
            "idle_before": [(name[:60], n, round(t / 1e3, 3)) for name, (n, t) in top_gaps]}


def run_cache(model, kind: str, b: int, ctx: int, steps: int, prefill: bool, compile_mode: str, oscar_setup):
    """One (cache, workload) row: prefill (or set the lengths), then timed decode steps."""
    from transformers import DynamicCache, StaticCache

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = model.config
    max_len = ctx + 3 * steps + 8  # timed steps, then launch_split's 2 x steps, warm-up and profile steps
    row = {"cache": kind, "B": b, "context": ctx}
    ids = torch.randint(1, cfg.vocab_size, (b, ctx), device="cuda")
    if kind.startswith("oscar"):
        cache = oscar_setup.make_cache(b, max_len)
    elif kind == "bf16-static":
        cache = StaticCache(config=cfg, max_cache_len=max_len)
    else:
        cache = DynamicCache(config=cfg)
    with torch.no_grad():
        if prefill:  # first calls compile kernels (Triton JIT, cuDNN plans): not part of the prefill's time
            warm = oscar_setup.make_cache(b, 2100) if kind.startswith("oscar") else StaticCache(config=cfg, max_cache_len=2100)
            model(ids[:, :2048], logits_to_keep=1, **kw(model, warm))
            del warm
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if prefill and kind.startswith("oscar"):
            model(ids, logits_to_keep=1, **kw(model, cache))
        elif prefill:
            for s in range(0, ctx, PREFILL_CHUNK):
                e = min(ctx, s + PREFILL_CHUNK)
                pos = torch.arange(s, e, device="cuda")[None].expand(b, -1)
                model(ids[:, s:e], position_ids=pos, logits_to_keep=1, **kw(model, cache))
        else:
            _fill_without_prefill(model, kind, cache, ids, ctx)
        torch.cuda.synchronize()
        if prefill:
            row["prefill_s"] = time.perf_counter() - t0
            row["prefill_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        tok = torch.randint(1, cfg.vocab_size, (b, 1), device="cuda")
        pos = torch.full((b, 1), ctx, device="cuda")
        kwargs = kw(model, cache)
        if kind.startswith("oscar-graph"):  # the eager forward captured once with torch.cuda.graph (no compiler)
            fwd = None
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(tok, position_ids=pos, **kwargs)  # a real step: compiles the kernels
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(tok, position_ids=pos, **kwargs)

            def step():
                pos.add_(1)
                graph.replay()
        else:
            fwd = model.forward if kind == "bf16-dynamic" else torch.compile(model.forward, mode=compile_mode,
                                                                               fullgraph=True)

            def step():
                nonlocal pos
                out = fwd(tok, position_ids=pos, **kwargs)
                pos = pos + 1
                return out

        t0 = time.perf_counter()
        for _ in range(3):  # compile + cudagraph record
            step()
        torch.cuda.synchronize()
        row["warmup_s"] = time.perf_counter() - t0
        times = time_steps(step, steps)
        row["decode_ms"] = statistics.median(times)
        row["tokens_per_s"] = b * 1e3 / row["decode_ms"]
        row.update(launch_split(step, steps))
        try:
            row["profile"] = profile_step(step)
        except Exception as e:  # the profiler is a nice-to-have: never lose the row for it
            row["profile"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if kind.startswith("oscar"):
            row["status_ok"] = bool((cache.step_status() == 0).all())
            row["cache_gib"] = cache.allocated_bytes() / 2**30
        else:
            row["cache_gib"] = _bf16_cache_bytes(cfg, b, max_len if kind == "bf16-static" else ctx) / 2**30
    # a graph left alive made every later row's replay block the host ~1 ms; the reset halves that (BENCHMARKS.md,
    # "Decode v3, tuned": the rest is not found)
    if kind.startswith("oscar-graph"):
        graph.reset()
    del cache, step
    gc.collect()
    return row


def _bf16_cache_bytes(cfg, b, length):
    return cfg.num_hidden_layers * b * length * 2 * cfg.num_key_value_heads * cfg.head_dim * 2


def _fill_without_prefill(model, kind, cache, ids, ctx):
    """Give every sequence ``ctx`` tokens without computing them (decode speed does not depend on the values)."""
    b = ids.shape[0]
    if kind.startswith("oscar"):
        model(ids[:, :16], logits_to_keep=1, **kw(model, cache))  # writes 16 real tokens, then jump the lengths
        cache.book.seq_len.fill_(ctx)
        cache.book.commit(0)
        cache.seen.fill_(ctx)
        return
    cfg = model.config
    if kind == "bf16-static":
        model(ids[:, :16], logits_to_keep=1, **kw(model, cache))
        for layer in cache.layers:
            layer.cumulative_length.fill_(ctx)
        return
    z = torch.zeros(b, cfg.num_key_value_heads, ctx, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    for i in range(cfg.num_hidden_layers):
        cache.update(z, z.clone(), i)


def oscar_sequence_bytes(layout, key_bits, ctx: int) -> int:
    """Bytes one ``ctx``-token sequence occupies over all layers (each layer with its key code width)."""
    return sum(layout.with_key_bits(bits).sequence_bytes(ctx) for bits in key_bits)


def key_bits_of(kind: str, num_layers: int, k4_layers: set[int]) -> tuple[int, ...]:
    return tuple(4 if kind.endswith("-k4") and i in k4_layers else 2 for i in range(num_layers))


#: the mma16 cache kinds: kind suffix -> the decode variant (``decode_attention_v2.KERNELS``)
MMA16_KINDS = {"-v2": "fields", "-v3": "gluon", "-v3fm": "gluon", "-v3sm": "gluon"}
#: v3 kinds that set the launch plan's GL_FUSED_MERGE for their row: the merge in the split kernel's last programs
#: ("-v3fm") or its own launch ("-v3sm"); "-v3" runs whatever the plan says.
FUSED_MERGE_KINDS = {"-v3fm": True, "-v3sm": False}


@contextlib.contextmanager
def fused_merge_of(kind: str):
    """The row's ``launch_plan.GL_FUSED_MERGE`` (read by every v3 launch, so also by the one a graph captures)."""
    from oscar_export.kernels.aot import launch_plan

    flag = next((f for suffix, f in FUSED_MERGE_KINDS.items() if kind.endswith(suffix)), None)
    old = launch_plan.GL_FUSED_MERGE
    launch_plan.GL_FUSED_MERGE = old if flag is None else flag
    try:
        yield
    finally:
        launch_plan.GL_FUSED_MERGE = old


def oscar_setup(model, kind: str, key_bits: tuple[int, ...]):
    """``enable_oscar`` for an OSCAR cache kind: linear pages (v1), or mma16 pages with the kind's kernel."""
    from oscar_export.plugins.hf import enable_oscar

    variant = next((v for suffix, v in MMA16_KINDS.items() if kind.endswith(suffix)), None)
    if variant is None:
        return enable_oscar(model, key_bits=key_bits)
    from oscar_export.kernels.layout import KVCacheLayout

    cfg = model.config
    layout = KVCacheLayout.default(cfg.num_key_value_heads, cfg.head_dim, "channel", packing="mma16")
    return enable_oscar(model, layout=layout, key_bits=key_bits, decode_variant=variant)


def roofline(row, model, weight_bytes, bw, layout, key_bits):
    cfg = model.config
    b, ctx = row["B"], row["context"]
    if row["cache"].startswith("oscar"):
        kv = b * oscar_sequence_bytes(layout, key_bits, ctx)
    else:
        kv = _bf16_cache_bytes(cfg, b, ctx)
    row["roofline_ms"] = (weight_bytes + kv) / bw * 1e3
    row["roofline_frac"] = row["roofline_ms"] / row["decode_ms"]


def max_batch(bytes_per_seq: int, budget: int) -> int:
    return max(1, budget // bytes_per_seq)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--workloads", default="1x8192,1x32768,1x131072,8x32768",
                    help="BxL list; a trailing '!' (e.g. 8x32768!) sets lengths instead of prefilling")
    ap.add_argument("--caches", default="oscar,bf16-static,bf16-dynamic")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--equal-kv-gib", type=float, default=0.0, help="also run the equal-KV-memory rows (0: skip)")
    ap.add_argument("--equal-context", type=int, default=32768)
    ap.add_argument("--equal-oscar", default="oscar-graph",
                    help="the OSCAR cache kinds of the equal-memory rows (comma-separated)")
    ap.add_argument("--k4-layers", default="", help="layers with 4-bit keys in the *-k4 caches, e.g. 0-15")
    ap.add_argument("--json", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    from oscar_export.calibration.key_bits import parse_layers

    k4 = set(parse_layers(args.k4_layers))
    if any(c.endswith("-k4") for c in args.caches.split(",") + args.equal_oscar.split(",")) and not k4:
        raise SystemExit("the *-k4 caches need --k4-layers")
    torch._dynamo.config.cache_size_limit = 64
    print(env_line(args.commit), flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    model = build(args.model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{args.model}: {weight_bytes / 2**30:.1f} GiB of weights", flush=True)
    caches = args.caches.split(",")
    plan = []
    for w in args.workloads.split(","):
        direct = w.endswith("!")
        b, ctx = (int(x) for x in w.rstrip("!").split("x"))
        plan += [(c, b, ctx, not direct) for c in caches]
    layout = None
    if args.equal_kv_gib:
        from oscar_export.kernels.layout import KVCacheLayout

        cfg = model.config
        layout = KVCacheLayout.default(cfg.num_key_value_heads, cfg.head_dim, "channel")
        budget = int(args.equal_kv_gib * 2**30)
        per_bf16 = _bf16_cache_bytes(cfg, 1, args.equal_context)
        plan.append(("bf16-static", max_batch(per_bf16, budget), args.equal_context, False))
        for kind in args.equal_oscar.split(","):
            bits = key_bits_of(kind, cfg.num_hidden_layers, k4)
            per_oscar = oscar_sequence_bytes(layout, bits, args.equal_context)
            plan.append((kind, max_batch(per_oscar, budget), args.equal_context, False))
    rows = []
    for kind, b, ctx, prefill in plan:
        if kind == "bf16-dynamic" and prefill:
            prefill = False  # eager DynamicCache decode is timed on a directly filled cache
        key_bits = key_bits_of(kind, model.config.num_hidden_layers, k4)
        setup = oscar_setup(model, kind, key_bits) if kind.startswith("oscar") else None
        try:
            with fused_merge_of(kind):
                row = run_cache(model, kind, b, ctx, args.steps, prefill, args.compile_mode, setup)
            if setup is not None:
                layout = setup.layout
        except torch.OutOfMemoryError as e:
            row = {"cache": kind, "B": b, "context": ctx, "error": f"out of memory: {str(e)[:120]}"}
        except Exception as e:  # noqa: BLE001 - e.g. a kernel that does not compile: the row says so, the run goes on
            row = {"cache": kind, "B": b, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            if setup is not None:
                setup.restore()
        if "decode_ms" in row and layout is not None:
            roofline(row, model, weight_bytes, bw, layout, key_bits)
        if kind.startswith("oscar"):
            row["k4_layers"] = [i for i, bits in enumerate(key_bits) if bits == 4]
            row["page_bits"] = (sum(layout.with_key_bits(bits).int2_bits_per_element() for bits in key_bits)
                                / len(key_bits))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env_line(args.commit), "copy_bw": bw, "model": args.model, "rows": rows}, f, indent=1)
    return 0


def print_table(rows) -> None:
    print("\n| cache | B x L | page bits | prefill s | prefill peak GiB | decode ms/step | tokens/s | peak GiB | roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['cache']} | {r['B']}x{r['context']} | {r['error']} |")
            continue
        pf = f"{r['prefill_s']:.2f}" if "prefill_s" in r else "-"
        pp = f"{r['prefill_peak_gib']:.1f}" if "prefill_peak_gib" in r else "-"
        rf = f"{r['roofline_frac']:.0%}" if "roofline_frac" in r else "-"
        pb = f"{r['page_bits']:.2f}" if "page_bits" in r else "16"
        print(f"| {r['cache']} | {r['B']}x{r['context']} | {pb} | {pf} | {pp} | {r['decode_ms']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | {rf} |")


if __name__ == "__main__":
    raise SystemExit(main())
