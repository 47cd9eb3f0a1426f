"""Calibrate OSCAR rotations, clips and scalings for a model and write the artifact directory.

Runs the model on calibration text (default: the first 70 % of Python's pydoc topics, offline), streams
float64 statistics of the post-RoPE queries, keys and values of every layer, fits per-layer (per-KV-head)
transforms on held-out sequences with the exact INT2 reference quantizer, and writes ``oscar.json`` +
``rotations.safetensors``. Prints a per-layer summary: held-out attention-aware error relative to plain
INT2 (identity, no clip) and to Hadamard + the research code's global clips.

Models larger than one GPU: ``--device-map auto`` (or ``balanced``, ``sequential``, a device such as ``cuda:0``,
or a JSON object ``{"module name": device}``) loads the model through accelerate, layers spread over the GPUs.
Capture then runs where each layer lives: a layer's float64 statistics are accumulated on that layer's device
(``calibration.capture.Collector``) and moved to the CPU once, when that layer is fitted; held-out rows go to
the CPU as they are captured (they are bounded by ``--heldout``). Fitting runs on the CPU. At the end the peak
memory torch allocated on each GPU is printed and recorded in the artifact's stats (``peak_gpu_memory_bytes``).
On the CPU, a device map (accelerate hooks on every layer) gives the same artifact as a plain run
(``tests/calibration/test_capture.py``, ``tests/oscar_export/test_calibrate.py``). The multi-GPU run itself
is untested here (no multi-GPU machine): ``benchmarks/calibrate_tp.py`` is the script that measures it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EPILOG = """examples:
  oscar-export calibrate --model default --out art   # 4-bit keys in the layers that need them, pages 3.0 bits/element
  oscar-export calibrate --model default --out art --key-bits-budget none   # 2-bit keys everywhere (ONNX / TensorRT)
  oscar-export calibrate --model ./my-llama --out art --data notes.txt chats.jsonl --seq-len 1024 --shared
  oscar-export calibrate --model default --out art --key-granularity token --clip global --rotation oscar
  oscar-export calibrate --model default --out art --force     # replace the artifact in art/ (atomically)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from oscar_export.calibration.config import CalibrationConfig
    from oscar_export.calibration.covariance import VALUE_WEIGHTINGS
    from oscar_export.calibration.key_bits import DEFAULT_BUDGET, METRICS
    from oscar_export.calibration.key_bits import MIN_SEQ_LEN as KEY_BITS_SEQ_LEN
    from oscar_export.calibration.rotation import ROTATION_KINDS

    d = CalibrationConfig()
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M) or a local HF model directory")
    p.add_argument("--out", required=True, help="artifact directory to write (new or empty; see --force)")
    p.add_argument("--force", action="store_true", help="replace an existing artifact directory at --out")
    p.add_argument("--data", nargs="+", default=list(d.data), metavar="SRC",
                   help="'pydoc' (built-in), 'generate' (the model's own answers to seed prompts), "
                        ".txt or .jsonl files")
    p.add_argument("--tokens", type=int, default=d.tokens, help=f"calibration token budget (default {d.tokens})")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence (default {KEY_BITS_SEQ_LEN}; {d.seq_len} with --key-bits-budget none)")
    p.add_argument("--heldout", type=int, default=d.heldout,
                   help=f"held-out sequences for clip fitting (default {d.heldout})")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--per-head", dest="per_head", action="store_true", default=d.per_head,
                   help="one rotation and clip per KV head (default)")
    g.add_argument("--shared", dest="per_head", action="store_false", help="one rotation and clip per layer")
    p.add_argument("--rotation", choices=("auto", *ROTATION_KINDS), default=d.rotation,
                   help="'auto' keeps the best held-out candidate per head (default)")
    p.add_argument("--scale", choices=("auto", "none", "whiten"), default=d.scale)
    p.add_argument("--clip", choices=("fitted", "global", "none"), default=d.clip)
    p.add_argument("--key-granularity", choices=("token", "channel"), default=d.key_granularity)
    p.add_argument("--value-weighting", choices=VALUE_WEIGHTINGS, default=d.value_weighting)
    p.add_argument("--no-key-mean", dest="key_mean", action="store_false", default=d.key_mean)
    p.add_argument("--no-value-mean", dest="value_mean", action="store_false", default=d.value_mean)
    p.add_argument("--codebook", choices=("auto", "off", "on"), default=d.codebook)
    p.add_argument("--sink", type=int, default=d.sink)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--key-bits-budget", type=parse_budget, default=DEFAULT_BUDGET, metavar="BITS",
                   help=f"give 4-bit keys to the layers whose held-out key attention error they reduce most, while the "
                        f"pages average at most BITS bits per element (default {DEFAULT_BUDGET}; "
                        f"2-bit pages are 2.5 for G = P = 64); 'none': 2-bit keys in every layer, the format the "
                        f"ONNX / TensorRT export reads")
    p.add_argument("--key-bits-metric", choices=METRICS, default=d.key_bits_metric,
                   help="what 4-bit keys must reduce: 'kl' (attention KL, default) or 'top' (probability moved on the "
                        "most-attended page rows)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device-map", default=None,
                   help="spread a large model over the GPUs (accelerate): 'auto', 'balanced', 'sequential', a device, "
                        "or a JSON object {module: device}; prints the peak memory per GPU at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-layer table")


def parse_budget(text: str) -> float | None:
    """``--key-bits-budget``: bits per element, or ``none`` (2-bit keys in every layer)."""
    return None if text.strip().lower() == "none" else float(text)


#: bounds of the numeric options that the artifact's LIMITS do not already state (sink, window, page size).
MAX_TOKENS = 1 << 31
MAX_SEQ_LEN = 1 << 20
MAX_BATCH_SIZE = 4096
MAX_SEED = 2**63 - 1


#: the named strategies ``--device-map`` passes to transformers / accelerate as they are.
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_device_map(text: str | None) -> str | dict | None:
    """``--device-map``: a strategy name, a device (``cpu``, ``cuda``, ``cuda:1``) or a JSON object mapping
    module names to devices (a GPU index, ``"cpu"``, ``"cuda:1"``); raises ``UserError`` for anything else."""
    import json
    import re

    from oscar_export.cli import UserError

    if text is None or text in DEVICE_MAP_STRATEGIES or re.fullmatch(r"cpu|cuda(:\d+)?", text):
        return text
    if text.lstrip().startswith("{"):
        try:
            dm = json.loads(text)
        except ValueError as e:
            raise UserError(f"--device-map: not a JSON object ({e})") from None
        bad = [k for k, v in dm.items() if not (type(v) is int and v >= 0 or isinstance(v, str)
                                                and re.fullmatch(r"cpu|cuda(:\d+)?", v))]
        if bad:
            raise UserError(f"--device-map: expected devices (a GPU index, 'cpu', 'cuda:N'), got {dm[bad[0]]!r} "
                            f"for {bad[0]!r}")
        return dm
    raise UserError(f"--device-map: expected one of {list(DEVICE_MAP_STRATEGIES)}, a device ('cpu', 'cuda:N') or a "
                    f"JSON object {{module: device}}, got {text!r}")


def check_device_map(device_map: str | dict | None) -> None:
    """Every device ``--device-map`` names exists here (``cli.check_device``), before the model loads."""
    from oscar_export.cli import check_device

    devices = device_map.values() if isinstance(device_map, dict) else [device_map]
    for dev in devices:
        if dev is not None and dev not in DEVICE_MAP_STRATEGIES:
            check_device(dev, "--device-map")


def gpu_peak_memory() -> dict[str, int]:
    """Peak bytes torch allocated on each CUDA device since the process started (or the last reset); ``{}``
    when CUDA was never used."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {f"cuda:{i}": int(torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count())}


def format_peak_memory(peaks: dict[str, int]) -> str:
    """``"cuda:0 12.3 GiB, cuda:1 11.9 GiB"``."""
    return ", ".join(f"{dev} {b / 2**30:.1f} GiB" for dev, b in peaks.items())


def check_args(args: argparse.Namespace) -> None:
    """Every option and ``--out``, checked before the model loads (minutes before the artifact is written)."""
    from oscar_export.calibration.artifact import LIMITS, META_FILE
    from oscar_export.cli import UserError, check_int
    from oscar_export.out_dir import check_out_dir

    check_int(args.tokens, "--tokens", 1, MAX_TOKENS)
    if args.seq_len is not None:
        check_int(args.seq_len, "--seq-len", 1, MAX_SEQ_LEN)
    check_int(args.batch_size, "--batch-size", 1, MAX_BATCH_SIZE)
    check_int(args.sink, "--sink", 0, LIMITS.max_sink)
    check_int(args.window, "--window", 0, LIMITS.max_window)
    check_int(args.page_size, "--page-size", LIMITS.min_page_size, LIMITS.max_page_size, multiple_of=16)
    check_int(args.seed, "--seed", 0, MAX_SEED)
    for src in args.data:
        if src not in ("pydoc", "generate") and not Path(src).is_file():
            raise UserError(f"--data {src}: no such file (expected 'pydoc', 'generate', or a .txt/.jsonl file)")
    inputs = [("--model", None if args.model == "default" else args.model),
              *(("--data", src) for src in args.data if src not in ("pydoc", "generate"))]
    check_out_dir(args.out, args.force, looks_like=META_FILE, inputs=inputs, claim=True)
    check_device_map(parse_device_map(args.device_map))


def config_from_args(args: argparse.Namespace):
    """The ``CalibrationConfig`` of the options; ``--seq-len`` unset is the config's default, or
    ``key_bits.MIN_SEQ_LEN`` with ``--key-bits-budget`` (the recipe docs/evaluation.md measures)."""
    from oscar_export.calibration.config import CalibrationConfig
    from oscar_export.calibration.key_bits import MIN_SEQ_LEN

    seq_len = args.seq_len
    if seq_len is None:
        seq_len = MIN_SEQ_LEN if args.key_bits_budget is not None else CalibrationConfig().seq_len
    return CalibrationConfig(
        tokens=args.tokens, seq_len=seq_len, heldout=args.heldout, batch_size=args.batch_size,
        per_head=args.per_head, rotation=args.rotation, scale=args.scale, clip=args.clip,
        key_granularity=args.key_granularity, value_weighting=args.value_weighting, key_mean=args.key_mean,
        value_mean=args.value_mean, codebook=args.codebook, sink=args.sink, window=args.window,
        page_size=args.page_size, data=tuple(args.data), seed=args.seed, key_bits_budget=args.key_bits_budget,
        key_bits_metric=args.key_bits_metric,
    )


def _r(x: float | None) -> str:
    """A ratio to 3 decimals, or '-' where the baseline does not exist (no Hadamard for this head_dim)."""
    return "-" if x is None else f"{x:.3f}"


def warn_short_key_bits_sequences(cfg) -> None:
    """One stderr line when ``--key-bits-budget`` chooses layers on held-out sequences shorter than
    ``key_bits.MIN_SEQ_LEN`` (measured to choose worse ones)."""
    from oscar_export.calibration.key_bits import MIN_SEQ_LEN

    if cfg.key_bits_budget is not None and cfg.seq_len < MIN_SEQ_LEN:
        print(f"warning: --key-bits-budget with --seq-len {cfg.seq_len}: the held-out queries read only "
              f"{cfg.seq_len - cfg.sink - cfg.window} page rows per sequence; --seq-len {MIN_SEQ_LEN} chose better "
              f"layers on SmolLM2 (57 vs 51 of 160 needles as deployed)", file=sys.stderr)


def key_bits_line(art) -> str:
    """One line naming the layers calibration gave wider keys (``--key-bits-budget``)."""
    wide = [i for i, b in enumerate(art.key_bits) if b != art.layout.key.bits]
    kb = art.stats.get("key_bits", {})
    return (f"key bits: 4-bit keys in {len(wide)} of {art.num_layers} layers {wide} (budget {kb.get('budget')} page "
            f"bits, metric {kb.get('metric')}; pages now {art.bits_per_element():.3f} bits/element)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from oscar_export.atomic_dir import atomic_dir
    from oscar_export.calibration.artifact import META_FILE
    from oscar_export.calibration.families import family_for
    from oscar_export.calibration.key_bits import check_budget
    from oscar_export.calibration.pipeline import calibrate
    from oscar_export.models import DEFAULT_MODEL, load_model, model_config

    check_args(args)  # validate before the slow model load
    cfg = config_from_args(args)
    warn_short_key_bits_sequences(cfg)
    # refuse what serving cannot run (enable_oscar's message) and a budget below the 2-bit pages before loading
    facts = None
    if (Path(args.model) / "config.json").is_file() or args.model == DEFAULT_MODEL:  # the config, or the embedded
        facts = family_for(model_config(args.model))  # GGUF's header: milliseconds, no weights (models.model_config)
    if facts is not None and cfg.key_bits_budget is not None:
        check_budget(cfg.key_bits_budget, cfg.layout(facts.num_kv_heads, facts.head_dim))
    t0 = time.perf_counter()
    kw = {"device_map": parse_device_map(args.device_map)} if args.device_map else {}
    if not args.quiet and args.model == "default":  # one whole-file parse of the GGUF, for the weights (models.py)
        print("loading the default model (SmolLM2-135M GGUF, about 15 s on 2 cores) ...", file=sys.stderr, flush=True)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype), **kw)
    t_load = time.perf_counter() - t0
    bars = {"capture": tqdm(total=cfg.num_sequences * cfg.seq_len, unit="tok", desc="capture", disable=args.quiet,
                            file=sys.stderr)}

    def phase(name: str) -> tqdm:
        """The bar of phase ``name`` (capture, fit, key bits), the previous phase's closed when it opens."""
        if name not in bars:
            for b in bars.values():
                b.close()
            bars[name] = tqdm(total=family_for(model).num_layers, unit="layer", desc=name, disable=args.quiet,
                              file=sys.stderr)
        return bars[name]

    def on_layer(i: int, s: dict) -> None:
        first = "fit" not in bars
        phase("fit").update(1)
        if args.quiet:
            return
        if first:
            tqdm.write(f"{'layer':>5} {'K err':>9} {'K/id':>6} {'K/had':>6} {'K rot':>10} {'K clip':>6}   "
                       f"{'V err':>9} {'V/id':>6} {'V/had':>6} {'V rot':>10} {'V clip':>6}", file=sys.stderr)
        cols = []
        for side in "kv":
            x = s[side]
            rot = ",".join(sorted(set(x["rotation"])))
            cols.append(f"{x['relative_error']:9.3g} {_r(x['vs_identity']):>6} {_r(x['vs_hadamard']):>6} "
                        f"{rot[:10]:>10} {min(x['clip']):6.3f}")
        tqdm.write(f"{i:5d} " + "   ".join(cols), file=sys.stderr)

    art = calibrate(model, tok, cfg, progress=bars["capture"].update, on_layer=on_layer,
                    on_key_bits=lambda n: phase("key bits").update(n))
    for b in bars.values():
        b.close()
    if cfg.key_bits_budget is not None:
        print(key_bits_line(art), file=sys.stderr)
    art.stats["seconds_load"] = round(t_load, 2)
    peaks = gpu_peak_memory()
    if peaks:
        art.stats["peak_gpu_memory_bytes"] = peaks
    with atomic_dir(args.out, force=args.force, looks_like=META_FILE) as tmp:
        art.save(tmp)
    layers = art.stats["layers"]
    def mean(side: str, key: str) -> str:
        vals = [layer[side][key] for layer in layers if layer[side][key] is not None]
        return _r(sum(vals) / len(vals) if vals else None)

    print(
        f"wrote {args.out}: {art.num_layers} layers, {art.layout.num_kv_heads} KV heads, "
        f"keys {art.layout.key.granularity}, {art.bits_per_element():.2f} bits/element (INT2 part); "
        f"held-out error vs identity K {mean('k', 'vs_identity')} V {mean('v', 'vs_identity')}, "
        f"vs Hadamard+clip K {mean('k', 'vs_hadamard')} V {mean('v', 'vs_hadamard')}; "
        f"{time.perf_counter() - t0:.0f} s (load {t_load:.0f} s)"
    )
    if peaks:
        print(f"peak GPU memory (torch allocated): {format_peak_memory(peaks)}")
    return 0
