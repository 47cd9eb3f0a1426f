"""Time the decode attention serving would launch on this GPU against PyTorch SDPA BF16 and the copy roofline.

For each shape, the layer's kernel is the one ``select_backend`` gives this GPU for the default layout (the Hopper
kernel over mma16 pages on sm_90, else the portable kernel over linear pages; the reason is printed when it is not
the fastest). Random codes and parameters (speed does not depend on them), queries already in the stored key basis;
CUDA-graph replays over input sets rotated to defeat the L2, median per call; bytes from ``KVCacheLayout``. Part of
the installed package: no source checkout needed. The numbers of record and the scripts that made them:
docs/kernels.md. The benchmarks' random inputs live here too: :func:`random_state` (a paged cache) and
:func:`random_artifact` (a calibrated model's shape, for the end-to-end benchmark and the GPU tests).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

EPILOG = """examples:
  oscar-export bench                                          # Llama-3-8B heads, 1x8K 1x32K 1x128K 8x32K, token keys
  oscar-export bench --shapes 1x8192,8x32768 --keys token,channel --key-bits 2,4
  oscar-export bench --heads gemma3-12b --shapes 1x32768 --json bench.json
"""

#: (query heads, KV heads, head_dim) of the benchmarked attention layers, by the model they come from.
HEADS = {"llama3-8b": (32, 8, 128), "qwen3-8b": (32, 8, 128), "gemma3-12b": (16, 8, 256), "gemma3-27b": (32, 16, 256)}
SHAPES = "1x8192,1x32768,1x131072,8x32768"
MAX_TOKENS = 1 << 24  # batch x length: 16M tokens of Llama-3-8B heads is ~40 GB of BF16 cache for SDPA


def add_arguments(p) -> None:
    p.add_argument("--heads", default="llama3-8b", choices=sorted(HEADS), help="attention shape (default llama3-8b)")
    p.add_argument("--shapes", default=SHAPES, help=f"comma list of BATCHxLENGTH (default {SHAPES})")
    p.add_argument("--keys", default="token", help="comma list of key granularities: token, channel (default token)")
    p.add_argument("--key-bits", default="2", help="comma list of key code widths: 2, 4 (default 2)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x8192,8x32768"`` -> ``[(1, 8192), (8, 32768)]``; ``ValueError`` naming the bad entry."""
    out = []
    for item in text.split(","):
        b, _, s = item.strip().partition("x")
        if not (b.isdigit() and s.isdigit()) or int(b) < 1 or int(s) < 1 or int(b) * int(s) > MAX_TOKENS:
            raise ValueError(f"--shapes: expected BATCHxLENGTH with batch x length in [1, {MAX_TOKENS}], "
                             f"got {item.strip()!r}")
        out.append((int(b), int(s)))
    return out


def parse_choices(text: str, option: str, allowed: tuple) -> list:
    """A comma list of ``allowed`` values (ints when ``allowed`` holds ints)."""
    kind = type(allowed[0])
    items = [x.strip() for x in text.split(",")]
    bad = [x for x in items if x not in {str(a) for a in allowed}]
    if bad:
        raise ValueError(f"{option}: expected a comma list of {list(allowed)}, got {bad[0]!r}")
    return [kind(x) for x in items]


def graph_us(fns, reps: int = 20) -> float:
    """Per-call µs of one CUDA graph that calls every ``fns[i]`` once (one per rotated input set)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(times)


def input_sets(nbytes: int) -> int:
    """How many copies of ``nbytes`` of inputs make 4x the L2 (2 to 32)."""
    import torch

    return max(2, min(32, math.ceil(4 * torch.cuda.get_device_properties(0).L2_cache_size / max(1, nbytes))))


def copy_tbps() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second, TB/s."""
    import torch

    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (graph_us([lambda: b.copy_(a)], reps=10) * 1e-6) / 1e12


def git_commit(cwd: str | Path | None = None) -> str:
    """The short commit of the checkout holding ``cwd`` (default: this package's folder), or ``""`` outside one."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent if cwd is None else cwd).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def env_line(commit: str | None = None) -> str:
    """GPU, torch and Triton versions, and the code's git commit (``commit`` when given: a copied tree's ``.git`` can
    be stale; none for an installed wheel outside a checkout): the first line of every benchmark's output."""
    import torch
    import triton

    commit = git_commit() if commit is None else commit
    line = f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}"
    return line + (f" | git {commit}" if commit else "")


class ByteTokenizer:
    """UTF-8 bytes as token ids modulo ``vocab``: the tokenizer the calibration of a random-weight model reads its
    text through (it needs no vocabulary)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        import torch

        return {"input_ids": torch.tensor([[b % self.vocab for b in text.encode()]])}


def random_state(layout, batch: int, length: int):
    """A paged cache of ``batch`` sequences of ``length`` tokens: random codes (valid in any packing), parameters
    and windows, pages shuffled over the pool."""
    import torch

    from oscar_export.kernels.layout import PagedKV

    sink, pages, recent = layout.split(length)
    st = PagedKV.allocate(layout, batch, max(1, batch * pages), max(1, pages), device="cuda")
    st.k_codes.random_(0, 256)
    st.v_codes.random_(0, 256)
    for p in (st.k_params, st.v_params):
        p.copy_(torch.rand_like(p, dtype=torch.float32) * 0.1 - 0.05)
    for t in (st.sink_k, st.sink_v, st.recent_k, st.recent_v):
        t.normal_()
    if pages:
        st.block_table.copy_(torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages))
    st.sink_len.fill_(sink)
    st.num_pages.fill_(pages)
    st.recent_len.fill_(recent)
    return st


@dataclass(frozen=True)
class RandomArtifact:
    """What ``enable_oscar`` reads of an artifact (``layout``, ``transforms``, ``key_bits``, ``check_model``)."""

    layout: object
    transforms: tuple
    key_bits: tuple[int, ...]

    def check_model(self, config) -> None:
        pass


def random_artifact(model, seed: int = 0, layout=None, key_bits: tuple[int, ...] | None = None) -> RandomArtifact:
    """A calibrated model's shape with random numbers, for benchmarks and tests of a random-weight model: per KV head
    a random orthogonal ``R_K`` and scalings ``d_K`` in [0.5, 2], key and value means, clip ratios 0.96 / 0.92,
    values pre-rotated (an exported checkpoint). ``layout``: default ``KVCacheLayout.default`` with channel keys;
    ``key_bits`` per layer: default 4-bit keys in every other layer (half, as the default recipe's 3.0 page-bit
    budget gives)."""
    import torch

    from oscar_export.kernels.layout import KVCacheLayout
    from oscar_export.kernels.transform import LayerTransform

    cfg = model.config
    hkv, d, n = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    transforms = []
    for _ in range(n):
        base = LayerTransform.identity(hkv, d, 0.96, 0.92)
        rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g))[0].contiguous()
        transforms.append(LayerTransform(
            k_rotation=rot, v_rotation=base.v_rotation, k_scale=2 ** (2 * torch.rand(hkv, d, generator=g) - 1),
            v_scale=base.v_scale, k_mean=0.1 * torch.randn(hkv, d, generator=g),
            v_mean=0.01 * torch.randn(hkv, d, generator=g), k_clip=base.k_clip, v_clip=base.v_clip,
            k_levels=base.k_levels, v_levels=base.v_levels, values_prerotated=True,
        ))
    layout = KVCacheLayout.default(hkv, d, "channel") if layout is None else layout
    key_bits = tuple(4 if i % 2 == 0 else 2 for i in range(n)) if key_bits is None else tuple(key_bits)
    if len(key_bits) != n:
        raise ValueError(f"key_bits: expected {n} entries (one per layer), got {len(key_bits)}")
    return RandomArtifact(layout, tuple(transforms), key_bits)


def bench_row(heads: str, batch: int, length: int, keys: str, bits: int, copy: float) -> dict:
    """One layer at one shape: the serving kernel and SDPA BF16 over the same tokens."""
    import torch
    import torch.nn.functional as F

    from oscar_export.kernels.decode import select_backend
    from oscar_export.kernels.layout import KVCacheLayout

    hq, hkv, d = HEADS[heads]
    base = KVCacheLayout.default(hkv, d, keys).with_key_bits(bits)
    backend = select_backend(base, torch.device("cuda"), hq)
    layout = backend.layout(base)
    if backend.name == "hopper":
        from oscar_export.kernels.decode.hopper import decode_attention
    else:
        from oscar_export.kernels.decode.portable import decode_attention
    nbytes = batch * layout.sequence_bytes(length) + 2 * batch * hq * d * 2  # cache + BF16 queries + outputs
    sets = input_sets(nbytes)
    states = [random_state(layout, batch, length) for _ in range(sets)]
    qs = [torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    levels = torch.tensor([0.0, 1.0, 2.0, 3.0], device="cuda").repeat(hkv, 1)
    ours = graph_us([lambda i=i: decode_attention(qs[i], states[i], layout, levels, levels, d**-0.5,
                                                  out_dtype=torch.bfloat16) for i in range(sets)])
    states.clear()  # the graph is done with them: free the memory before SDPA's cache
    ssets = input_sets(2 * batch * hkv * length * d * 2)
    ks = [torch.randn(batch, hkv, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(ssets)]
    vs = [torch.randn_like(k) for k in ks]
    q4 = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    sdpa = graph_us([lambda i=i: F.scaled_dot_product_attention(q4, ks[i], vs[i], scale=d**-0.5, enable_gqa=True)
                     for i in range(ssets)])
    tbps = nbytes / (ours * 1e-6) / 1e12
    return dict(heads=heads, batch=batch, length=length, keys=keys, key_bits=bits, backend=backend.name,
                why=backend.why, packing=layout.key.packing, us=round(ours, 2), sdpa_us=round(sdpa, 2),
                x_sdpa=round(sdpa / ours, 2), bytes=nbytes, tbps=round(tbps, 3), roofline=round(tbps / copy, 3))


def run(args) -> int:
    import json

    import torch

    shapes = parse_shapes(args.shapes)
    keys = parse_choices(args.keys, "--keys", ("token", "channel"))
    bits = parse_choices(args.key_bits, "--key-bits", (2, 4))
    if not torch.cuda.is_available():
        raise NotImplementedError("bench: the decode-kernel benchmark needs a CUDA GPU (none visible)")
    env = env_line()  # imports Triton: without it, ImportError before anything runs
    copy = copy_tbps()
    env = f"{env} | copy {copy:.2f} TB/s"
    print(env)
    print("| B x length | keys | bits | backend | µs | SDPA BF16 µs | x SDPA | TB/s | of copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for batch, length in shapes:
        for k in keys:
            for b in bits:
                r = bench_row(args.heads, batch, length, k, b, copy)
                rows.append(r)
                print(f"| {batch}x{length} | {k} | {b} | {r['backend']} ({r['packing']}) | {r['us']} | "
                      f"{r['sdpa_us']} | {r['x_sdpa']} | {r['tbps']} | {r['roofline']:.0%} |", flush=True)
                if r["why"]:
                    print(f"  ({r['backend']}: {r['why']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, copy_tbps=copy, rows=rows), f, indent=1)
    return 0
