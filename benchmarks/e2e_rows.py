"""The columns of ``bench_e2e.py``'s rows computed from the measured ones, and its table: the cache bytes of one
sequence (BF16 ``StaticCache``, OSCAR from the layout), the rooflines, the ratios to the BF16 row of a workload.

Two anchors. The row's own roofline (its bytes at the copy bandwidth) says how close the step runs to its floor.
The **BF16 roofline** of a workload, the weights a step reads plus a BF16 cache of the same sequences read once at
the copy bandwidth, is the time no BF16 engine can beat (a good one comes close): ``vs_bf16_roofline`` > 1 means
the step is faster than any BF16 engine could be at that shape."""

from __future__ import annotations


def bf16_cache_bytes(cfg, b, length):
    """Bytes of transformers' BF16 ``StaticCache`` of ``b`` sequences of ``length`` tokens (K and V, all layers)."""
    return cfg.num_hidden_layers * b * length * 2 * cfg.num_key_value_heads * cfg.head_dim * 2


def oscar_sequence_bytes(layout, key_bits, ctx: int) -> int:
    """Bytes one ``ctx``-token sequence occupies over all layers (each layer with its key code width)."""
    return sum(layout.with_key_bits(bits).sequence_bytes(ctx) for bits in key_bits)


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter, but of an untied input embedding only the rows of
    the step's tokens (counted as none)."""
    emb = model.get_input_embeddings().weight
    tied = emb is model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - emb.numel() * emb.element_size()


def bf16_roofline_ms(cfg, weight_bytes, bw, b, ctx) -> float:
    """The BF16 roofline of ``b`` sequences of ``ctx`` tokens: weights + a BF16 cache read once at ``bw``."""
    return (weight_bytes + bf16_cache_bytes(cfg, b, ctx)) / bw * 1e3


def add_roofline(row, cfg, weight_bytes, bw, art) -> None:
    """``roofline_ms``: the step's bytes (weights + the cache bytes it must read) at the copy bandwidth ``bw``;
    ``roofline_frac``: that over the step time; ``bf16_roofline_ms`` of the same workload and
    ``vs_bf16_roofline``, that over the step time (tokens/s over the BF16 roofline's at the same batch)."""
    b, ctx = row["B"], row["context"]
    kv = b * (oscar_sequence_bytes(art.layout, art.key_bits, ctx) if row["cache"].startswith("oscar")
              else bf16_cache_bytes(cfg, 1, ctx))
    row["roofline_ms"] = (weight_bytes + kv) / bw * 1e3
    row["roofline_frac"] = row["roofline_ms"] / row["step_ms"]
    row["bf16_roofline_ms"] = bf16_roofline_ms(cfg, weight_bytes, bw, b, ctx)
    row["vs_bf16_roofline"] = row["bf16_roofline_ms"] / row["step_ms"]


def add_equal_kv_roofline(row, cfg, weight_bytes, bw, bf16_batch: int) -> None:
    """An equal-KV-budget row: ``bf16_roofline_ms`` and ``bf16_roofline_tokens_per_s`` of the BF16 batch that fits
    the same budget, and ``vs_bf16_roofline``, the row's tokens/s over the latter."""
    ms = row["bf16_roofline_ms"] = bf16_roofline_ms(cfg, weight_bytes, bw, bf16_batch, row["context"])
    row["bf16_roofline_tokens_per_s"] = bf16_batch / ms * 1e3
    row["vs_bf16_roofline"] = row["tokens_per_s"] / row["bf16_roofline_tokens_per_s"]


def add_ratios(rows) -> None:
    """OSCAR rows: ``speedup`` (BF16 step / OSCAR step at the same workload; at equal KV budget, the throughput
    ratio), ``compile_ratio``, ``prefill_ratio``, ``peak_ratio`` (OSCAR / BF16)."""
    bf16 = {(r["B"], r["context"], r.get("equal_kv", False)): r
            for r in rows if r["cache"] == "bf16" and "step_ms" in r}
    for r in rows:
        if not r["cache"].startswith("oscar") or "step_ms" not in r:
            continue
        if r.get("equal_kv"):
            ref = next((x for (_, c, e), x in bf16.items() if e and c == r["context"]), None)
            if ref is not None:
                r["throughput_ratio"] = r["tokens_per_s"] / ref["tokens_per_s"]
            continue
        ref = bf16.get((r["B"], r["context"], False))
        if ref is None:
            continue
        r["speedup"] = ref["step_ms"] / r["step_ms"]
        for key, name in (("compile_s", "compile_ratio"), ("prefill_s", "prefill_ratio"), ("peak_gib", "peak_ratio")):
            if key in r and key in ref:
                r[name] = r[key] / ref[key]


def print_table(rows) -> None:
    print("\n| cache | B x L | step ms | vs BF16 | BF16 roofline ms | vs BF16 roofline | own roofline | compile s "
          "(Dynamo / Inductor / first run) | prefill s | peak GiB | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda r, k, fmt: format(r[k], fmt) if k in r else "-"  # noqa: E731
    for r in rows:
        lab = f"{r['B']}x{r['context']}" + (" (equal KV)" if r.get("equal_kv") else "")
        if "error" in r:
            print(f"| {r['cache']} | {lab} | {r['error']} |")
            continue
        ratio = f(r, "speedup", ".2f") if "speedup" in r else f(r, "throughput_ratio", ".1f")
        split = (f" ({r['dynamo_s']:.1f} / {r['inductor_s']:.1f} / {r['first_run_s']:.1f})" if "dynamo_s" in r
                 else "")
        print(f"| {r['cache']} | {lab} | {r['step_ms']:.2f} | {ratio} | {f(r, 'bf16_roofline_ms', '.2f')} | "
              f"{f(r, 'vs_bf16_roofline', '.2f')} | {f(r, 'roofline_frac', '.0%')} | "
              f"{r['compile_s']:.1f}{split} | {f(r, 'prefill_s', '.2f')} | {f(r, 'peak_gib', '.1f')} | "
              f"{r['tokens_per_s']:.0f} |")
