"""End to end on the GPU: the README's serving loop, OSCAR beside BF16 ``StaticCache``, in one process.

    python benchmarks/bench_e2e.py [--model llama3-8b|qwen3-8b] [--workloads 1x32768,1x131072,8x32768]
        [--equal-kv-gib 64 --equal-context 32768] [--graph-rows] [--json out.json] [--deadline-s 420]

Random BF16 weights of a real shape (speed does not depend on them) and, for OSCAR, a random artifact of a
calibrated model's shape (:func:`random_artifact`: per-KV-head random orthogonal key rotations and per-coordinate
scalings, key and value means, channel keys, 4-bit keys in half the layers — about what the default recipe picks
—, values pre-rotated as in an exported checkpoint). Per workload ``B x L``, each row:

* ``oscar``: ``enable_oscar(model, artifact)`` (the decode backend and page packing ``select_backend`` picks for
  each layer on this GPU), ``make_cache(B, L + steps)``, the prompt prefilled in one forward, then the README loop:
  ``step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``; each layer's append launch
  rotates the step's queries into the stored key basis once, and the decode kernel reads them as they are.
* ``bf16``: transformers' ``StaticCache``, prefilled in 8K chunks, the same compiled step.
* with ``--graph-rows``, ``oscar-graph``: the same OSCAR cache with its eager forward captured by
  ``torch.cuda.graph`` (no compiler): an extra, labelled row.

Per row: ``step_ms`` (median of CUDA-event timings of single steps), ``compile_s`` (the first compiled call: Dynamo
+ Inductor + the first run) split into ``dynamo_s`` (tracing, guards), ``inductor_s`` (AOT autograd + Inductor,
its Triton kernels included) and ``first_run_s`` (the rest of the first call: the graph's first run, which
JIT-compiles the custom ops' Triton / Gluon kernels, OSCAR's decode kernels, unless ``plugins/hf/precompile.py``'s
workers have), ``jit_kernels`` (the kernels that first call wrote into Triton's cache folder other than Inductor's
``triton_*`` ones: the custom ops' kernels compiled in this process), ``cache_s`` (making the cache),
``warmup_s`` (the first three calls, CUDA-graph recording included), ``prefill_s``,
``peak_gib`` (``max_memory_allocated`` over prefill and decode), ``roofline_frac`` (the step's bytes — weights +
the cache bytes it must read, from the layout — at the copy bandwidth measured in the same run, over the step
time), ``bf16_roofline_ms`` / ``vs_bf16_roofline`` (the same workload's BF16 roofline, the floor of any BF16
engine, over the step time: ``e2e_rows.py``) and, for OSCAR, the ratios to the BF16 row of the same workload.
``--equal-kv-gib`` adds one row per cache at its largest batch whose cache fits the budget at ``--equal-context``
tokens (lengths set directly, no prefill: decode speed does not depend on the values), the throughput ratio and the
BF16 roofline's throughput at that budget. ``--deadline-s``: no row starts after that
many seconds (the JSON is written after every row).

Compile caches: the run starts with empty Triton and Inductor cache folders (fresh temporary ones, as on a new
machine; ``--keep-caches`` uses the usual ones), so the first row compiles everything; later rows of the same run
reuse the kernels an earlier row compiled (the dense layers' Inductor kernels are the same for both caches) and the
process's one-time costs (imports, Inductor's worker pool): the cache named first in ``--caches`` pays the cold
compile. A new user's first compile of each cache is one process per cache (``benchmarks/gpu_compile.sh``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time

import torch

from oscar_export.bench import random_artifact

from e2e_compile import clear_compile_timers, compile_split, fresh_caches, triton_binaries
from e2e_rows import (
    add_equal_kv_roofline,
    add_ratios,
    add_roofline,
    bf16_cache_bytes,
    oscar_sequence_bytes,
    print_table,
    step_weight_bytes,
)

MODELS = {
    "llama3-8b": dict(kind="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144),
    "qwen3-8b": dict(kind="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144),
    # a CPU smoke test of this script (``--model tiny --device cpu``): the same code paths at toy sizes
    "tiny": dict(kind="llama", vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096),
}
PREFILL_CHUNK = 8192


def env_line(device: torch.device, commit: str | None = None) -> dict:
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    sha = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "triton": tv, "transformers": transformers.__version__, "commit": sha + ("+dirty" if dirty else ""),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def build(name: str, device: torch.device, layers: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    spec = dict(MODELS[name], **({} if layers is None else {"num_hidden_layers": layers}))
    kind = spec.pop("kind")
    cfg = (LlamaConfig if kind == "llama" else Qwen3Config)(**spec)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with device:
        model = (LlamaForCausalLM if kind == "llama" else Qwen3ForCausalLM)(cfg)
    torch.set_default_dtype(prev)
    return model.eval()


def copy_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth in bytes/s (read + write of a 4 GiB buffer, median of 10)."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(2**31, dtype=torch.bfloat16, device=device)
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


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, n: int, device) -> list[float]:
    """Milliseconds of ``n`` single synchronised steps (CUDA events; wall clock on the CPU)."""
    out = []
    for _ in range(n):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def run_row(model, kind: str, b: int, ctx: int, steps: int, prefill: bool, setup, device, compiler: str) -> dict:
    """One (cache, workload) row: prefill (or set the lengths), compile the step, time it."""
    from transformers import StaticCache

    torch._dynamo.reset()
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    cfg = model.config
    max_len = ctx + steps + 8
    oscar = kind.startswith("oscar")
    row = {"cache": kind, "B": b, "context": ctx}
    ids = torch.randint(1, cfg.vocab_size, (b, ctx), device=device)
    new_cache = (lambda n: setup.make_cache(b, n)) if oscar else (lambda n: StaticCache(config=cfg, max_cache_len=n))
    with torch.no_grad():
        if prefill:  # first calls compile kernels (Triton JIT, cuDNN plans): not part of the prefill's time
            warm = new_cache(min(2100, ctx + 8))
            model(ids[:, : min(2048, ctx)], logits_to_keep=1, **kw(model, warm))
            del warm
            _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        cache = new_cache(max_len)
        _sync(device)
        row["cache_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if not prefill:
            _fill_without_prefill(model, oscar, cache, ids, ctx)
        else:
            fill_by_prefill(model, oscar, cache, ids)
        _sync(device)
        if prefill:
            row["prefill_s"] = time.perf_counter() - t0
        tok = torch.randint(1, cfg.vocab_size, (b, 1), device=device)
        pos = torch.full((b, 1), ctx, device=device)
        kwargs = kw(model, cache)
        graph = None
        if kind == "oscar-graph":  # the eager forward captured once with torch.cuda.graph (no compiler)
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
        else:  # the README loop
            mode = "reduce-overhead" if compiler == "inductor" else None
            fwd = torch.compile(model.forward, mode=mode, fullgraph=True, backend=compiler)

            def step():
                nonlocal pos
                out = fwd(tok, position_ids=pos, **kwargs)
                pos = pos + 1
                return out

        clear_compile_timers()
        before = triton_binaries()
        t0 = time.perf_counter()
        step()
        _sync(device)
        row["compile_s"] = time.perf_counter() - t0
        row["jit_kernels"] = sorted(os.path.basename(f)[:-6] for f in triton_binaries() - before
                                    if not os.path.basename(f).startswith("triton_"))
        if kind != "oscar-graph":
            row.update(compile_split(row["compile_s"]))
        for _ in range(2):  # CUDA-graph recording
            step()
        _sync(device)
        row["warmup_s"] = time.perf_counter() - t0
        times = time_steps(step, steps, device)
        row["step_ms"] = statistics.median(times)
        row["step_ms_all"] = [round(t, 3) for t in times]
        row["tokens_per_s"] = b * 1e3 / row["step_ms"]
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if oscar:
            row["status_ok"] = bool((cache.step_status() == 0).all())
            row["cache_gib"] = cache.allocated_bytes() / 2**30
            row["backends"] = sorted({be.name for be in setup.decode_backends})
        else:
            row["cache_gib"] = bf16_cache_bytes(cfg, b, max_len) / 2**30
    if graph is not None:
        graph.reset()
    del cache, step
    torch._dynamo.reset()
    gc.collect()
    return row


def fill_by_prefill(model, oscar: bool, cache, ids) -> None:
    """Prefill ``ids`` ``[B, L]``: OSCAR in one forward, BF16 ``StaticCache`` in ``PREFILL_CHUNK``-token chunks."""
    if oscar:
        model(ids, logits_to_keep=1, **kw(model, cache))
        return
    for s in range(0, ids.shape[1], PREFILL_CHUNK):
        e = min(ids.shape[1], s + PREFILL_CHUNK)
        pos = torch.arange(s, e, device=ids.device)[None].expand(ids.shape[0], -1)
        model(ids[:, s:e], position_ids=pos, logits_to_keep=1, **kw(model, cache))


def _fill_without_prefill(model, oscar: bool, cache, ids, ctx):
    """Give every sequence ``ctx`` tokens without computing them (decode speed does not depend on the values)."""
    model(ids[:, :16], logits_to_keep=1, **kw(model, cache))  # 16 real tokens, then jump the lengths
    if oscar:
        cache.book.seq_len.fill_(ctx)
        cache.book.commit(0)
        cache.seen.fill_(ctx)
    else:
        for layer in cache.layers:
            layer.cumulative_length.fill_(ctx)


def kernel_jit(name: str, device: torch.device, ctx: int = 8192) -> dict:
    """Seconds the README loop's decode step spends compiling its kernels (Triton / Gluon JIT, this process's cache
    folders): ``name``'s attention shape with two layers (4-bit and 2-bit keys: every kernel variant the full model
    launches, the layouts being per key width), a ``ctx``-token cache, 16 prompt tokens (their writers compiled
    first); the first eager decode step (``jit_step_s``) minus the second (``step_s``) is ``jit_s``."""
    from oscar_export.plugins.hf import enable_oscar

    model = build(name, device, layers=2)
    with torch.no_grad(), enable_oscar(model, random_artifact(model)) as setup:
        cache = setup.make_cache(1, ctx)
        ids = torch.randint(1, model.config.vocab_size, (1, 16), device=device)
        model(ids, logits_to_keep=1, **kw(model, cache))
        _sync(device)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            model(ids[:, :1], **kw(model, cache))
            _sync(device)
            times.append(time.perf_counter() - t0)
        backends = [b.name for b in setup.decode_backends]
    return {"cache": "oscar-jit", "model": name, "layers": 2, "key_bits": list(random_artifact(model).key_bits),
            "backends": backends, "jit_step_s": times[0], "step_s": times[1], "jit_s": times[0] - times[1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workloads", default="1x32768,1x131072,8x32768",
                    help="BxL list; a trailing '!' (e.g. 8x32768!) sets lengths instead of prefilling")
    ap.add_argument("--caches", default="bf16,oscar", help="the caches of each workload (bf16, oscar)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--graph-rows", action="store_true", help="also an oscar-graph row per workload (no compiler)")
    ap.add_argument("--equal-kv-gib", type=float, default=0.0, help="also the equal-KV-budget rows (0: skip)")
    ap.add_argument("--equal-context", type=int, default=32768)
    ap.add_argument("--compiler", default="inductor", help="torch.compile backend of the step (inductor, with "
                    "mode='reduce-overhead': the README's; 'eager' for a quick CPU smoke test of this script)")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="start no row after this many seconds (0: none)")
    ap.add_argument("--jit-only", action="store_true", help="only time the decode step's kernel JIT (kernel_jit)")
    ap.add_argument("--keep-caches", action="store_true", help="use the usual Triton / Inductor cache folders "
                    "(default: fresh empty ones, a new machine's compile)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse here; a copy of the "
                    "working tree on another machine may carry stale git metadata)")
    args = ap.parse_args(argv)
    if not args.keep_caches:
        fresh_caches()
    from oscar_export.plugins.hf import enable_oscar

    t_start = time.perf_counter()
    device = torch.device(args.device)
    torch._dynamo.config.cache_size_limit = 64
    env = env_line(device, args.commit)
    print(json.dumps(env), flush=True)
    if args.jit_only:
        row = kernel_jit(args.model, device)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "argv": argv, "rows": [row]}, f, indent=1)
        return 0
    bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    model = build(args.model, device)
    cfg = model.config
    weight_bytes = step_weight_bytes(model)
    art = random_artifact(model)
    print(f"{args.model}: {weight_bytes / 1e9:.2f} GB of weights a step reads; 4-bit key layers "
          f"{[i for i, x in enumerate(art.key_bits) if x == 4]}", flush=True)
    plan = []
    for w in filter(None, args.workloads.split(",")):  # "" : the equal-KV rows only
        direct = w.endswith("!")
        b, ctx = (int(x) for x in w.rstrip("!").split("x"))
        kinds = args.caches.split(",") + (["oscar-graph"] if args.graph_rows else [])
        plan += [(k, b, ctx, not direct, False) for k in kinds]
    bf16_batch = 0
    if args.equal_kv_gib:
        budget = int(args.equal_kv_gib * 2**30)
        bf16_batch = max(1, budget // bf16_cache_bytes(cfg, 1, args.equal_context))
        plan.append(("bf16", bf16_batch, args.equal_context, False, True))
        per = oscar_sequence_bytes(art.layout, art.key_bits, args.equal_context)
        plan.append(("oscar", max(1, budget // per), args.equal_context, False, True))
    rows = []
    out = {"env": env, "copy_bw": bw, "model": args.model, "argv": argv, "rows": rows}
    for kind, b, ctx, prefill, equal in plan:
        if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
            rows.append({"cache": kind, "B": b, "context": ctx, "equal_kv": equal, "error": "not run: deadline"})
            continue
        setup = enable_oscar(model, art) if kind.startswith("oscar") else None
        try:
            row = run_row(model, kind, b, ctx, args.steps, prefill, setup, device, args.compiler)
        except torch.OutOfMemoryError as e:
            row = {"cache": kind, "B": b, "context": ctx, "error": f"out of memory: {str(e)[:160]}"}
        except Exception as e:  # noqa: BLE001 - the row says what failed, the run goes on
            row = {"cache": kind, "B": b, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        finally:
            if setup is not None:
                setup.restore()
        row["equal_kv"] = equal
        if "step_ms" in row and device.type == "cuda":
            add_roofline(row, cfg, weight_bytes, bw, art)
            if equal:
                add_equal_kv_roofline(row, cfg, weight_bytes, bw, bf16_batch)
        rows.append(row)
        add_ratios(rows)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    print_table(rows)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
