"""Where the README loop's decode step spends its GPU time: kernels of the compiled step, by kind, OSCAR beside BF16.

    python benchmarks/profile_step.py [--model llama3-8b] [--workload 1x32768] [--steps 5] [--json out.json]

The same model, random artifact and loop as ``bench_e2e.py`` (lengths set; ``--prefill``: a random prompt
prefilled), the step compiled with ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``; after
three warm-up calls ``torch.profiler`` records ``--steps`` steps (the kernels replayed from the step's CUDA graph are
recorded one by one). Each kernel is put in one kind by its name (:data:`KINDS`, first match); per kind: microseconds
a step, launches a step. The sum over kinds is the GPU's busy time; the step time (CUDA events, median of 20) minus
it is the idle time between kernels. The host side: ``host_ms`` (median wall time of the call alone, the GPU idle
before it: when it is near ``step_ms`` the step is bound by the host) and, with ``--host-profile N``, cProfile's top
functions by own time over N steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_e2e  # noqa: E402  (the model, artifact and lengths of the end-to-end benchmark)

#: (kind, substrings of a kernel name), first match wins; the rest is "other".
KINDS = (
    ("oscar append", ("_decode_append_kernel",)),
    ("oscar decode attention", ("decode_split", "_decode_merge", "decode_attention", "_gl_kernel")),
    ("gemm / gemv", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90_", "splitK")),
    ("attention (SDPA)", ("flash", "fmha", "attention", "softmax")),
    ("inductor fusions", ("triton_",)),
    ("copies / fills", ("copy", "fill", "elementwise", "index", "Memcpy", "Memset")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def profile(model, cache_kind: str, b: int, ctx: int, steps: int, device, host_profile: int = 0,
            prefill: bool = False) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import StaticCache

    from oscar_export.bench import random_artifact
    from oscar_export.plugins.hf import enable_oscar

    torch._dynamo.reset()
    cfg = model.config
    setup = enable_oscar(model, random_artifact(model)) if cache_kind == "oscar" else None
    try:
        with torch.no_grad():
            n = ctx + 3 + 20 + 20 + host_profile + steps + 16  # every step below stores one token
            cache = setup.make_cache(b, n) if setup else StaticCache(config=cfg, max_cache_len=n)
            if prefill:
                ids = torch.randint(1, cfg.vocab_size, (b, ctx), device=device)
                bench_e2e.fill_by_prefill(model, setup is not None, cache, ids)
            else:
                ids = torch.randint(1, cfg.vocab_size, (b, 16), device=device)
                bench_e2e._fill_without_prefill(model, setup is not None, cache, ids, ctx)
            tok = torch.randint(1, cfg.vocab_size, (b, 1), device=device)
            pos = torch.full((b, 1), ctx, device=device)
            kwargs = bench_e2e.kw(model, cache)
            fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):
                fwd(tok, position_ids=pos, **kwargs)
            torch.cuda.synchronize()
            step_ms = statistics.median(bench_e2e.time_steps(lambda: fwd(tok, position_ids=pos, **kwargs), 20, device))
            host = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fwd(tok, position_ids=pos, **kwargs)
                host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            hot = ""
            if host_profile:
                prof_host = cProfile.Profile()
                prof_host.enable()
                for _ in range(host_profile):
                    fwd(tok, position_ids=pos, **kwargs)
                torch.cuda.synchronize()
                prof_host.disable()
                buf = io.StringIO()
                pstats.Stats(prof_host, stream=buf).sort_stats("tottime").print_stats(30)
                hot = buf.getvalue()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    fwd(tok, position_ids=pos, **kwargs)
                torch.cuda.synchronize()
    finally:
        if setup is not None:
            setup.restore()
    us, launches, names = defaultdict(float), defaultdict(int), defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        k = kind_of(ev.name)
        t = ev.time_range.elapsed_us()
        us[k] += t / steps
        launches[k] += 1
        names[ev.name] += t / steps
    busy = sum(us.values())
    top = sorted(names.items(), key=lambda x: -x[1])[:12]
    return {"cache": cache_kind, "B": b, "context": ctx, "prefill": prefill, "step_ms": step_ms,
            "host_ms": statistics.median(host), "busy_ms": busy / 1e3, "host_profile": hot,
            "idle_ms": step_ms - busy / 1e3,
            "kinds": {k: {"us_per_step": round(us[k], 1), "launches_per_step": launches[k] / steps}
                      for k in sorted(us, key=lambda x: -us[x])},
            "top_kernels_us": {n[:120]: round(t, 1) for n, t in top}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(bench_e2e.MODELS))
    ap.add_argument("--workload", default="1x32768", help="BxL")
    ap.add_argument("--caches", default="oscar,bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prefill", action="store_true", help="prefill a random prompt (default: lengths set)")
    ap.add_argument("--host-profile", type=int, default=0, help="cProfile this many steps (0: none)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    b, ctx = (int(x) for x in args.workload.split("x"))
    model = bench_e2e.build(args.model, device)
    out = {"env": bench_e2e.env_line(device, args.commit), "model": args.model, "rows": []}
    for c in args.caches.split(","):
        row = profile(model, c, b, ctx, args.steps, device, args.host_profile, args.prefill)
        out["rows"].append(row)
        print(f"\n{c} {b}x{ctx}: step {row['step_ms']:.2f} ms, host {row['host_ms']:.2f} ms, GPU busy "
              f"{row['busy_ms']:.2f} ms, idle {row['idle_ms']:.2f} ms")
        for k, v in row["kinds"].items():
            print(f"  {k:24s} {v['us_per_step']:9.1f} us  {v['launches_per_step']:6.1f} launches")
        for n, t in row["top_kernels_us"].items():
            print(f"    {t:8.1f} us  {n}")
        print(row["host_profile"])
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
