"""Per-layer decode attention on the GPU: the INT2 mixed-precision kernel vs PyTorch SDPA BF16 vs the copy roofline.

    python benchmarks/bench_decode.py [--shapes 1x8192,1x131072] [--json out.json]
    python benchmarks/bench_decode.py --heads gemma3-12b,gemma3-27b --shapes 1x8192,1x32768
    python benchmarks/bench_decode.py --key-bits 2,4 --shapes 1x8192,1x131072,8x32768
    python benchmarks/bench_decode.py --kernel hopper --gran channel --key-bits 2,4 --shapes 1x8192,8x32768
    python benchmarks/bench_decode.py --append 1,8 --key-bits 2,4

Heads (``--heads``): 32 query / 8 KV heads, head_dim 128 by default (docs/design.md §6); Gemma-3-12B (16 / 8) and
Gemma-3-27B (32 / 16) at head_dim 256, two groups of 128 per row.
Bytes come from ``KVCacheLayout.sequence_bytes`` (+ the
queries and outputs); times are medians of CUDA-event timings over input sets rotated to defeat the L2
(enough copies to exceed 4x the L2). ``graph`` times replay a CUDA graph of the two launches (how a
captured decode step runs), ``eager`` times plain launches. The portable kernel runs at its wrapper's defaults (the
launch plan's); the tuning variants measured on 2026-12-01 are in git history
(``git log -- benchmarks/bench_decode.py``).

``--key-bits 2,4`` times the kernel on layouts with 2-bit and with 4-bit key pages (``layout.with_key_bits``; values
stay 2-bit) in the same run; each row's bytes are that layout's (4-bit keys read ``D / 2`` code bytes a row), so
TB/s compare honestly. ``--kernel hopper`` times what ``oscar::decode_attention`` launches on a Hopper GPU instead:
the default layout's pages in mma16 order, fp32 queries already in the stored key basis (what the append launch
returns), the Gluon kernel at its launch plan's split and fused merge (``decode.hopper.decode_attention``); the
rotation's cost and the Hopper kernel's other layouts: ``bench_hopper.py``.

``--append B,..`` times the decode step's other launch instead, the cache write ``oscar::decode_append`` as the
README loop runs it (``triton_ops.plan_append`` once, then ``run_append``; the key transform fused, the step's
queries rotated, channel keys on mma16 pages), one row per batch, key width and step kind: ``plain`` (the token
into the ring) and ``demote`` (the ring full: a page of keys and values quantized too). Each over input sets of
distinct transforms and caches (their ``R_K`` 4x the L2, at most 256 sets: it comes from HBM, as in a step whose
weights flushed the L2); ``graph_us``: per launch in a CUDA graph of them, ``kernel_us``: the kernel's own time
from the profiler.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch
import torch.nn.functional as F

from oscar_export.bench import HEADS, copy_tbps, env_line, graph_us, random_state
from oscar_export.bench import input_sets as copies_for
from oscar_export.kernels import reference as ref
from oscar_export.kernels.decode import hopper
from oscar_export.kernels.decode.portable import decode_attention, default_pages_per_split
from oscar_export.kernels.layout import KVCacheLayout, PagedKV

HQ, HKV, D = HEADS["llama3-8b"]
SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 32768), (64, 8192)]
def median_ms(fn, sets: int, iters: int) -> float:
    """Median of per-call CUDA-event times; ``fn(i)`` runs on input set ``i % sets``."""
    for i in range(min(sets, 10)):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def mma16_copy(st: PagedKV, lay: KVCacheLayout) -> tuple[PagedKV, KVCacheLayout]:
    """The same tokens with the pages repacked to mma16 (reference.pack_page_codes), and that layout."""
    mlay = replace(lay, key=replace(lay.key, packing="mma16"), value=replace(lay.value, packing="mma16"))
    kc = ref.pack_page_codes(ref.unpack_page_codes(st.k_codes, lay.key), mlay.key, "key")
    vc = ref.pack_page_codes(ref.unpack_page_codes(st.v_codes, lay.value), mlay.value, "value")
    return replace(st, k_codes=kc.contiguous(), v_codes=vc.contiguous()), mlay


def bench_shape(batch: int, seq: int, gran: str, copy: float | None = None, heads: str = "llama3-8b",
                key_bits: int = 2, kernel: str = "portable") -> list[dict]:
    HQ, HKV, D = HEADS[heads]  # noqa: N806 (the module's letters)
    lay = KVCacheLayout.default(HKV, D, gran).with_key_bits(key_bits)
    if kernel == "hopper":
        lay = lay.with_packing("mma16")
    scale = D**-0.5
    kl = torch.tensor([0.0, 1.0, 2.0, 3.0], device="cuda").repeat(HKV, 1)
    q_dtype = torch.float32 if kernel == "hopper" else torch.bfloat16  # hopper: the append launch's q_s
    nbytes = batch * lay.sequence_bytes(seq) + batch * HQ * D * (q_dtype.itemsize + 2)  # cache + q in + out (bf16)
    sets = copies_for(nbytes)
    states = [random_state(lay, batch, seq) for _ in range(sets)]
    qs = [torch.randn(batch, HQ, D, device="cuda", dtype=q_dtype) for _ in range(sets)]
    max_pages = states[0].block_table.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if kernel == "hopper":
        variants = [dict(variant="hopper", pages_per_split=hopper.pages_per_split(
            batch, HKV, max_pages, torch.device("cuda"), D))]
    else:
        variants = [dict(variant="portable", pages_per_split=default_pages_per_split(batch, HKV, max_pages, sms))]
    rows = []
    for var in variants:
        kw = {k: v for k, v in var.items() if k != "variant"}
        fn = hopper.decode_attention if kernel == "hopper" else decode_attention
        call = lambda i, kw=kw, fn=fn: fn(qs[i % sets], states[i % sets], lay, kl, kl, scale,  # noqa: E731
                                          out_dtype=torch.bfloat16, **kw)
        eager = median_ms(call, sets, 30)
        graph = graph_us([lambda i=i: call(i) for i in range(sets)]) / 1e3
        rows.append(dict(kernel="oscar-hopper" if kernel == "hopper" else "oscar-int2", heads=heads, hq=HQ, hkv=HKV,
                         d=D, g=lay.key.group_size, gran=gran,
                         key_bits=key_bits, batch=batch, seq=seq, bytes=nbytes, eager_us=eager * 1e3,
                         graph_us=graph * 1e3, tbps=nbytes / (graph * 1e-3) / 1e12, **var))
        if copy:
            rows[-1]["roofline_us"] = nbytes / (copy * 1e12) * 1e6
            rows[-1]["pct_copy"] = 100 * rows[-1]["roofline_us"] / rows[-1]["graph_us"]
    states.clear()  # the graphs are done with them: free the memory before SDPA's cache
    # SDPA BF16 on the same shape: 32 q heads over 8 KV heads, one query token
    kv_bytes = 2 * batch * HKV * seq * D * 2
    ssets = copies_for(kv_bytes)
    ks = [torch.randn(batch, HKV, seq, D, device="cuda", dtype=torch.bfloat16) for _ in range(ssets)]
    vs = [torch.randn_like(k) for k in ks]
    qq = [torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(ssets)]
    sd = lambda i: F.scaled_dot_product_attention(qq[i % ssets], ks[i % ssets], vs[i % ssets], enable_gqa=True)  # noqa: E731
    eager = median_ms(sd, ssets, 50)
    graph = graph_us([lambda i=i: sd(i) for i in range(ssets)]) / 1e3
    rows.append(dict(kernel="sdpa-bf16", heads=heads, hq=HQ, hkv=HKV, d=D, gran="-", batch=batch, seq=seq,
                     bytes=kv_bytes, eager_us=eager * 1e3,
                     graph_us=graph * 1e3, tbps=kv_bytes / (graph * 1e-3) / 1e12))
    return rows


def bench_append(batch: int, key_bits: int, demote: bool, heads: str = "llama3-8b") -> dict:
    """One ``--append`` row (see the module doc)."""
    from oscar_export.kernels import triton_ops
    from oscar_export.kernels.transform import LayerTransform

    hq, hkv, d = HEADS[heads]
    lay = KVCacheLayout.default(hkv, d, "channel").with_packing("mma16").with_key_bits(key_bits)
    per_set = hkv * d * d * 4  # R_K: what must come from HBM (the cache rows a step touches are a few KB)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = min(256, -(-4 * l2 // per_set))  # 4x the L2 of R_K alone, at most 256 (128 MB at Llama-3-8B's heads)
    ident = LayerTransform.identity(hkv, d, 0.96, 0.92).to("cuda")
    trs, states = [], []
    for _ in range(sets):
        rot = torch.linalg.qr(torch.randn(hkv, d, d, device="cuda"))[0].contiguous()
        trs.append(replace(ident, k_rotation=rot, k_scale=torch.rand(hkv, d, device="cuda") + 0.5,
                           k_mean=0.1 * torch.randn(hkv, d, device="cuda")))
        st = random_state(lay, batch, lay.sink + 4 * lay.page_size + lay.recent_capacity)
        st.num_pages.fill_(2)  # block_table[b, 2] names the page a demotion writes
        st.recent_len.fill_(lay.recent_capacity - (0 if demote else 1))
        states.append(st)
    k = torch.randn(batch, hkv, d, device="cuda").bfloat16()
    q = torch.randn(batch, hq, d, device="cuda").bfloat16()
    status = torch.zeros(batch, dtype=torch.int32, device="cuda")
    plans = [triton_ops.plan_append(states[i], k, k, status, lay, trs[i], fused_transform=True, q=q)
             for i in range(sets)]  # made once, with the cache, as the HF cache does
    calls = [lambda i=i: triton_ops.run_append(plans[i], states[i], k, k, status, trs[i], q) for i in range(sets)]
    graph = graph_us(calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            for c in calls:
                c()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.name.startswith("_decode_append_kernel")]
    kernel_us = statistics.median(e.device_time for e in kern) if kern else float("nan")
    return dict(kernel="decode_append", heads=heads, batch=batch, key_bits=key_bits,
                step="demote" if demote else "plain", sets=sets, graph_us=graph, kernel_us=kernel_us)


def main_append(batches: list[int], key_bits: list[int], heads: str, json_path: str | None, commit) -> int:
    rows = []
    for b in batches:
        for kb in key_bits:
            for demote in (False, True):
                rows.append(bench_append(b, kb, demote, heads))
                print(json.dumps(rows[-1]), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(env=env_line(commit), rows=rows), f, indent=1)
    print(f"\n{'heads':>10} {'B':>3} {'kb':>2} {'step':>6} {'graph us':>9} {'kernel us':>9}")
    for r in rows:
        print(f"{r['heads']:>10} {r['batch']:>3} {r['key_bits']:>2} {r['step']:>6} {r['graph_us']:9.2f} "
              f"{r['kernel_us']:9.2f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES))
    ap.add_argument("--gran", default="token,channel")
    ap.add_argument("--json", default=None)
    ap.add_argument("--commit", default=None, help="commit to report (default: git rev-parse in this tree)")
    ap.add_argument("--heads", default="llama3-8b", help=f"comma list of {sorted(HEADS)}")
    ap.add_argument("--key-bits", default="2", help="comma list of key code widths (2, 4)")
    ap.add_argument("--kernel", default="portable", choices=("portable", "hopper"),
                    help="the decode kernel timed (module doc)")
    ap.add_argument("--append", default=None, help="comma list of batches: time decode_append instead (module doc)")
    args = ap.parse_args(argv)
    try:
        key_bits = [int(x) for x in args.key_bits.split(",")]
        for kb in key_bits:
            KVCacheLayout.default(HKV, D).with_key_bits(kb)  # the layout's own check of the width
    except (ValueError, NotImplementedError) as e:
        print(f"--key-bits {args.key_bits}: {e}")
        return 2
    print(env_line(args.commit))
    if args.append:
        return main_append([int(b) for b in args.append.split(",")], key_bits, args.heads.split(",")[0], args.json,
                           args.commit)
    bw = copy_tbps()
    print(f"device copy: {bw:.2f} TB/s (read + write)")
    rows = []
    for heads in args.heads.split(","):
        for shape in args.shapes.split(","):
            b, s = (int(x) for x in shape.split("x"))
            grans = args.gran.split(",")
            for gran, kb in ((g, k) for g in grans for k in key_bits):
                try:
                    got = bench_shape(b, s, gran, bw, heads, kb, args.kernel)
                except Exception as e:  # keep the other shapes' rows
                    print(f"FAILED {heads} {shape} {gran} key_bits={kb}: {type(e).__name__}: {e}", flush=True)
                    continue
                if gran != grans[0] or kb != key_bits[0]:
                    got = [r for r in got if r["kernel"] != "sdpa-bf16"]
                rows += got
                for r in got:
                    print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env_line(args.commit), copy_tbps=bw, rows=rows), f, indent=1)
    print(f"\n{'heads':>10} {'shape':>9} {'kernel':>13} {'gran':>7} {'kb':>2} {'pps':>4} "
          f"{'eager us':>9} {'graph us':>9} {'TB/s':>5} {'x SDPA':>6} {'%copy':>5}")
    sdpa = {(r["heads"], r["batch"], r["seq"]): r["graph_us"] for r in rows if r["kernel"] == "sdpa-bf16"}
    for r in rows:
        x = sdpa.get((r["heads"], r["batch"], r["seq"]), float("nan")) / r["graph_us"]
        pct = f"{r['pct_copy']:5.1f}" if "pct_copy" in r else "    -"
        print(f"{r['heads']:>10} {r['batch']}x{r['seq']:>6} {r['kernel']:>13} {r['gran']:>7} "
              f"{r.get('key_bits', '-'):>2} {r.get('pages_per_split', '-'):>4} {r['eager_us']:9.1f} "
              f"{r['graph_us']:9.1f} {r['tbps']:5.2f} {x:6.2f} {pct}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
