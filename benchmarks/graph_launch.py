"""Host cost of replaying a CUDA graph of decode-attention calls, per entry point (where a step's launch time goes).

    python benchmarks/graph_launch.py [--shape 1x32768] [--calls 32] [--json out.json]

The whole decode step (bench_e2e.py) replays one graph per token; its ``host_ms`` says how long that replay keeps the
host busy. This script captures ``--calls`` attention calls (one per layer of a Llama-3-8B-shaped step) into one graph
per entry point — the portable kernel (linear pages) and the hopper kernel (mma16 pages), each through the custom
op (``oscar::decode_attention``) and through its plain wrapper — and prints, per graph,
the median host time of ``graph.replay()`` and the GPU time per call, so a slow launch is pinned on the op, the
wrapper or the kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench_decode import HKV, HQ, D, env_line, mma16_copy, random_state  # noqa: E402  (same folder)
from oscar_export.kernels.decode import hopper, portable
from oscar_export.kernels import triton_ops
from oscar_export.kernels.layout import KVCacheLayout


def replay_times(fn, reps: int = 20) -> tuple[float, float]:
    """``(host ms, GPU ms)`` medians of replaying a graph of ``fn()``."""
    fn()  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        g.replay()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b))
    return statistics.median(host), statistics.median(gpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x32768")
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    b, s = (int(x) for x in args.shape.split("x"))
    lay = KVCacheLayout.default(HKV, D, "channel")
    st = random_state(lay, b, s)
    mst, mlay = mma16_copy(st, lay)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    lev = torch.tensor([0.0, 1.0, 2.0, 3.0], device="cuda").repeat(HKV, 1)
    kw = dict(out_dtype=torch.bfloat16)
    entries = {
        "portable op": lambda: triton_ops.decode_attention(q, st, lay, lev, lev, D**-0.5, **kw),
        "portable wrapper": lambda: portable.decode_attention(q, st, lay, lev, lev, D**-0.5, **kw),
    }
    if hopper.HAVE_GLUON:
        entries["hopper op"] = lambda: triton_ops.decode_attention(q, mst, mlay, lev, lev, D**-0.5, **kw)
        entries["hopper wrapper"] = lambda: hopper.decode_attention(q, mst, mlay, lev, lev, D**-0.5, **kw)
    print(env_line(args.commit))
    rows = []
    for name, fn in entries.items():
        try:
            host, gpu = replay_times(lambda fn=fn: [fn() for _ in range(args.calls)])
        except Exception as e:  # noqa: BLE001 - one failing entry must not lose the others
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rows.append(dict(entry=name, shape=args.shape, calls=args.calls, host_ms=host, gpu_ms=gpu))
        print(f"{name:>18}: replay host {host:7.3f} ms, GPU {gpu:7.3f} ms ({1e3 * gpu / args.calls:6.1f} us a call)",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env_line(args.commit), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
