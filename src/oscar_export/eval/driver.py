"""Evaluate KV-cache methods decode-as-deployed: PPL, KL, top-1, NIAH, bits per element.

Calibrates OSCAR on the model (unless --artifact is given), builds the baselines (BF16, naive INT2,
QuaRot-INT2, KIVI-2 at its defaults and at our budget, transformers' QuantizedCache with HQQ and quanto at 2
and 4 bits, the OSCAR research recipe) and scores them all on the same text and needles. Every quality number
comes from what decode sees: each position reads the BF16 windows relative to itself and INT2 everywhere
else. With --device cuda it also runs ours through the real cache as deployed (BF16 model + Triton kernels,
and the fp32 model + reference ops as a cross-check). Writes results.md, results.json and PNG plots to --out.
"""

from __future__ import annotations

import contextlib
import platform
import time
from dataclasses import fields

import torch

from .presets import PRESETS, Preset, preset_from_args

EPILOG = """examples:
  oscar-export eval --model default                  # the main job: calibrate into art/, evaluate at 2,048 tokens
  oscar-export eval --model default --preset quick   # CI preset (was --quick, still accepted)
  oscar-export eval --model default --artifact art/ --preset long  # 2K/4K/8K text, NIAH 1K-8K x 20 (hours on a CPU)
  oscar-export eval --model default --artifact art/ --methods bf16,oscar,kivi2 --no-niah
  oscar-export eval --model default --artifact art/ --preset full --device cuda    # the GPU protocol
"""


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M) or a local HF model dir")
    p.add_argument("--artifact", default=None, help="calibrated artifact directory (default: calibrate now)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--quick", action="store_true", help="same as --preset quick (kept for old scripts)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model runs; cuda also runs ours through the real cache as deployed")
    p.add_argument("--methods", default=None, help="comma-separated subset of method names (default: the preset's)")
    p.add_argument("--text-lengths", default=None, help="comma-separated text lengths (overrides the preset)")
    p.add_argument("--text-windows", type=int, default=None, help="text windows (overrides the preset)")
    p.add_argument("--niah-lengths", default=None, help="comma-separated NIAH lengths (overrides the preset)")
    p.add_argument("--needles", type=int, default=None, help="NIAH needles per task and length (overrides the preset)")
    p.add_argument("--split", choices=("dev", "report"), default="report",
                   help="needles and text windows: 'dev' for tuning, 'report' (default) for reported numbers (the "
                        "text windows from the end of the evaluation text instead of its start)")
    p.add_argument("--no-niah", action="store_true", help="skip needle-in-a-haystack")
    p.add_argument("--no-text", action="store_true", help="skip PPL/KL/top-1")
    p.add_argument("--no-deployed", action="store_true", help="with --device cuda: skip the real-cache runs")
    p.add_argument("--out", default="eval_out", help="output directory (default: eval_out/)")
    p.add_argument("--save-artifact", default="art", metavar="DIR",
                   help="where the artifact eval calibrates is saved, for the next commands (default: art/; an "
                        "artifact already there is evaluated instead when it fits the model, refused when not; not "
                        "used with --artifact)")
    p.add_argument("--force", action="store_true",
                   help="calibrate anew and replace the artifact in --save-artifact (what eval did not write there "
                        "is kept)")
    p.add_argument("--merge", default=None, metavar="RESULTS_JSON",
                   help="add the methods of an earlier results.json (same text and NIAH settings) to this run's")


def check_device(device: str) -> torch.device:
    """``torch.device(device)``, or a clear error when CUDA is asked for and there is none."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is available here (torch {torch.__version__}, "
                         f"CUDA build {torch.version.cuda or 'none'}); run without --device or on a GPU machine")
    return torch.device(device)


def check_lengths(model, preset: Preset, text: bool, niah: bool) -> None:
    """A clear error when a requested length exceeds the model's position limit."""
    limit = getattr(model.config, "max_position_embeddings", None)
    asked = ([("text length", L) for L in preset.text_lengths] if text else []) + \
            ([("NIAH length", L) for L in preset.niah_lengths] if niah else [])
    for what, L in asked:
        if limit is not None and L > limit:
            raise ValueError(f"{what} {L} exceeds the model's limit of {limit} positions "
                             f"(max_position_embeddings); ask for at most {limit}")


def build_methods(model, tok, preset: Preset, artifact, names: list[str] | None, log=print):
    """``(methods, skipped)``: the cache models to run and ``{name: why not}``."""
    from .quantizers import hf_backend_missing
    from .recipes import baseline_methods, ours_method, research_recipe
    from .text import calibration_text

    methods = baseline_methods(model, artifact.layout if artifact is not None else None)
    want = set(names) if names else None
    chosen = want if want is not None else set(preset.methods) if preset.methods is not None else None
    if chosen is None or "oscar-research" in chosen:
        ids = tok(calibration_text(), return_tensors="pt", add_special_tokens=False).input_ids[0]
        seq = 512
        n = max(1, preset.research_tokens // seq)
        methods.append(research_recipe(model, ids[: n * seq].view(n, seq)))
    if artifact is not None:
        methods.append(ours_method(artifact))
    if want is not None:
        unknown = want - {m.name for m in methods}
        if unknown:
            raise ValueError(f"--methods: unknown {sorted(unknown)}; available: {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in want or m.name == "bf16"]
    skipped = {}
    if want is None:
        for m in methods:
            if m.kind == "hf" and m.name not in preset.hf:
                skipped[m.name] = ("not in this preset (the QuantizedCache replay is slow on a CPU); "
                                   "--preset full or --methods runs it")
            elif preset.methods is not None and m.name not in preset.methods:
                skipped[m.name] = "not in this preset; --preset full or --methods runs it"
        methods = [m for m in methods if m.name not in skipped]
    dev = next(model.parameters()).device
    for m in [m for m in methods if m.kind == "hf"]:
        why = hf_backend_missing(m.backend, dev)
        if why:
            skipped[m.name] = why
            log(f"skipping {m.name}: {why}")
    return [m.to(dev) for m in methods if m.name not in skipped], skipped


def run_eval(model, tok, preset: Preset, artifact=None, names: list[str] | None = None, niah: bool = True,
             text: bool = True, split: str = "report", log=print) -> dict:
    """Build every method, score them (fake-quantized caches), return the JSON-able result dict."""
    from .niah import run_niah
    from .niah_prompts import NiahConfig, build_prompts
    from .niah_scoring import summarize
    from .recipes import attention_shape
    from .text import TextScore, final_hidden, max_positions, score_methods, text_windows

    t_start = time.perf_counter()
    attention_shape(model)
    check_lengths(model, preset, text, niah)
    if text:  # fails early if the text is too short
        windows = text_windows(tok, preset.text_lengths[-1], preset.text_windows, max_positions=max_positions(model),
                               split=split)
    if niah:
        cfg = NiahConfig(lengths=preset.niah_lengths, needles=preset.needles, split=split, tasks=preset.tasks)
        prompts = build_prompts(tok, cfg)
    t0 = time.perf_counter()
    methods, skipped = build_methods(model, tok, preset, artifact, names, log)
    timings = {"methods_s": round(time.perf_counter() - t0, 1)}
    lengths = sorted({*preset.text_lengths, *preset.niah_lengths})
    result = {
        "methods": [{**m.summary(), "bits": {str(L): m.bits_per_element(L) for L in lengths}} for m in methods],
        "skipped": skipped,
        "environment": environment(model),
        "protocol": "decode-as-deployed fake quantization inside attention (oscar_export.eval.attention); "
                    "every row rounded to bfloat16 before storage/quantization; model computes in "
                    f"{next(model.parameters()).dtype}",
    }
    if artifact is not None:
        result["artifact"] = {"config": getattr(artifact, "config", {}), "layout": artifact.layout.to_dict()}
    if text:
        t0 = time.perf_counter()
        T = windows.shape[1]
        pos = torch.arange(T - 1)
        scores = {L: {m.name: TextScore() for m in methods} for L in preset.text_lengths}
        head = model.get_output_embeddings()
        with _bar(len(methods) * windows.shape[0], "text (PPL/KL)") as b:
            for w in windows:
                ref = final_hidden(model, w, methods[0])
                hidden = {}  # [T, hidden] per method, scored together: the reference's logits once per chunk
                for m in methods:
                    b.set_postfix_str(m.name)
                    hidden[m.name] = ref if m is methods[0] else final_hidden(model, w, m)
                    b.update(1)
                part = score_methods(lambda c0, c1: head(ref[c0:c1]),
                                     {m.name: (lambda c0, c1, g=hidden[m.name]: head(g[c0:c1]), m.reads_quantized(pos))
                                      for m in methods}, w, preset.text_lengths)
                for m in methods:
                    for L in preset.text_lengths:
                        scores[L][m.name].add(part[m.name][L])
        result["text"] = {
            "source": "pydoc_data.topics, sorted topics joined by blank lines, last 30% of the characters; "
                      "length L = the first L tokens of each window"
                      + ("; windows ending at the text's end (split 'dev')" if split == "dev" else ""),
            "split": split,
            "lengths": {str(L): {"windows": int(windows.shape[0]),
                                 "scores": {k: {**v.summary(), "per_window_kl": v.per_window_kl}
                                            for k, v in scores[L].items()}} for L in preset.text_lengths},
        }
        timings["text_s"] = round(time.perf_counter() - t0, 1)
    if niah:
        t0 = time.perf_counter()
        niah_methods = methods
        with _bar(len(prompts), f"NIAH ({len(prompts)} prompts x {len(niah_methods)} methods)") as b:
            rows = run_niah(model, tok, niah_methods, prompts, cfg,
                            progress=lambda s: (b.set_postfix_str(s), b.update(1)))
        result["niah"] = {"config": cfg.to_dict(), "summary": summarize(rows), "rows": rows,
                          "methods": [m.name for m in niah_methods], "prompts": len(prompts)}
        timings["niah_s"] = round(time.perf_counter() - t0, 1)
    timings["total_eval_s"] = round(time.perf_counter() - t_start, 1)
    result["timings"] = timings
    return result


@contextlib.contextmanager
def _bar(total: int, desc: str):
    from tqdm.auto import tqdm

    b = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)
    try:
        yield b
    finally:
        b.close()


def environment(model) -> dict:
    import transformers

    p = next(model.parameters())
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "machine": platform.machine(), "cpu_threads": torch.get_num_threads(), "device": str(p.device),
           "dtype": str(p.dtype)}
    if p.is_cuda:
        env["gpu"] = torch.cuda.get_device_name(p.device)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    return env


def check_outputs(args) -> dict | None:
    """``--out`` writable and apart from the inputs, ``--merge`` read (a JSON object of an earlier run), before any
    model loads; returns the ``--merge`` results (None without it)."""
    import json
    from pathlib import Path

    from oscar_export.calibration.artifact import printable
    from oscar_export.cli import UserError
    from oscar_export.out_dir import check_writable

    check_writable(args.out, "--out", [("--model", None if args.model == "default" else args.model),
                                       ("--artifact", args.artifact), ("--merge", args.merge)])
    if args.merge is None:
        return None
    try:
        data = json.loads(Path(args.merge).read_bytes())
    except (ValueError, RecursionError) as e:
        raise UserError(f"--merge {printable(args.merge)}: not valid JSON ({printable(e, 160)})") from None
    if not isinstance(data, dict) or not isinstance(data.get("methods"), list):
        raise UserError(f"--merge {printable(args.merge)}: expected the JSON object of an earlier results.json "
                        f"(with a 'methods' list), got {type(data).__name__}")
    from .results_file import ResultsError, check_results

    try:
        return check_results(data)
    except ResultsError as e:
        raise UserError(f"--merge {printable(args.merge)}: not an earlier results.json: {printable(e, 200)}") from None


def run(args) -> int:
    preset = preset_from_args(args)
    device = check_device(args.device)
    merged = check_outputs(args)  # before the model loads: minutes before the results are written
    names = [s.strip() for s in args.methods.split(",")] if args.methods else None
    saved = None
    calibrating = not args.artifact and (names is None or "oscar" in names)
    if calibrating:  # --save-artifact: absent, empty, or an artifact (used, or with --force replaced): before the work
        from .saved_artifact import saved_artifact

        saved = saved_artifact(args, save_inputs(args))
        calibrating = saved is None
    from oscar_export.threads import cpu_run_threads

    with cpu_run_threads(device.type):  # one thread where other processes keep the cores busy
        return _run(args, preset, device, merged, names, calibrating, saved)


def _run(args, preset: Preset, device: torch.device, merged: dict | None, names: list[str] | None,
         calibrating: bool, saved=None) -> int:
    """:func:`run` once the options are checked: load, calibrate (or read the artifact), evaluate, write."""
    from oscar_export.models import load_model

    from .recipes import attention_shape
    from .report import headline, markdown, write_all

    t0, cpu0 = time.perf_counter(), time.process_time()
    model, tok = load_model(args.model, device=str(device))
    t_load = time.perf_counter() - t0
    attention_shape(model)
    check_lengths(model, preset, not args.no_text, not args.no_niah)
    if not args.no_text:  # before calibrating: a text too short for the windows fails at once
        from .text import max_positions, text_windows

        text_windows(tok, preset.text_lengths[-1], preset.text_windows, max_positions=max_positions(model),
                     split=args.split)
    if args.artifact:
        from oscar_export.calibration.artifact import load_artifact

        artifact = load_artifact(args.artifact, model.config)
    elif saved is not None:
        from .saved_artifact import use_saved

        artifact = use_saved(args, saved, model)
    elif calibrating:
        t1 = time.perf_counter()
        artifact = calibrate_and_save(model, tok, preset, args.save_artifact, save_inputs(args), args.force)
        t_cal = time.perf_counter() - t1
    else:
        artifact = None
    result = run_eval(model, tok, preset, artifact, names, niah=not args.no_niah, text=not args.no_text,
                      split=args.split)
    if device.type == "cuda" and not args.no_deployed and artifact is not None:
        from .deployed import run_deployed

        result = run_deployed(model, tok, preset, artifact, result, not args.no_text, not args.no_niah, args.split)
    result["command"] = "oscar-export eval " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in
                                                        sorted(vars(args).items()) if not k.startswith("_"))
    result["preset"] = {f.name: getattr(preset, f.name) for f in fields(preset)}
    result["timings"].update(load_s=round(t_load, 1), wall_s=round(time.perf_counter() - t0, 1),
                             cpu_s=round(time.process_time() - cpu0, 1))  # cpu_s: this process, every thread
    if calibrating:
        result["timings"]["calibrate_s"] = round(t_cal, 1)
    if merged is not None:
        from .report import merge

        result = merge(merged, result)
    paths = write_all(result, args.out)
    print(headline(result, paths))
    print(markdown(result))
    for k, p in paths.items():
        print(f"{k}: {p}")
    return 0


def save_inputs(args) -> list[tuple[str, str | None]]:
    """What ``--save-artifact`` must stay apart from."""
    return [("--model", None if args.model == "default" else args.model), ("--out", args.out),
            ("--merge", args.merge)]


def calibrate_and_save(model, tok, preset: Preset, out: str, inputs, force: bool = False) -> object:
    """Calibrate ours as ``preset.calibration_config()`` says (progress bars on stderr) and save the artifact to
    ``out`` (absent or empty; with ``force`` an earlier artifact there is replaced in one step), where the next
    commands read it."""
    import sys

    from tqdm.auto import tqdm

    from oscar_export.atomic_dir import atomic_dir
    from oscar_export.calibration.artifact import META_FILE

    from .recipes import attention_shape

    try:
        from oscar_export.calibration.pipeline import calibrate
    except ImportError as e:
        raise ImportError(f"eval needs oscar_export.calibration to calibrate (or pass --artifact): {e}") from e
    cfg = preset.calibration_config()
    t1 = time.perf_counter()
    budget = f"4-bit keys where they matter within {cfg.key_bits_budget} page bits" if cfg.key_bits_budget else \
        "2-bit keys everywhere"
    print(f"calibrating ours on {cfg.tokens} tokens of calibration text ({cfg.seq_len}-token sequences, {budget}) ...")
    n_layers = attention_shape(model)[0]
    bars = {"calibrate: capture": tqdm(total=cfg.num_sequences * cfg.seq_len, unit="tok", desc="calibrate: capture",
                                       file=sys.stderr)}

    def phase(desc: str):  # by name: a bar that TQDM_DISABLE turns off has no desc
        if desc not in bars:
            for b in bars.values():
                b.close()
            bars[desc] = tqdm(total=n_layers, unit="layer", desc=desc, file=sys.stderr)
        return bars[desc]

    try:
        art = calibrate(model, tok, cfg, progress=bars["calibrate: capture"].update,
                        on_layer=lambda i, s: phase("calibrate: fit").update(1),
                        on_key_bits=lambda n: phase("calibrate: key bits").update(n))
    finally:
        for b in bars.values():
            b.close()
    with atomic_dir(out, force=force, looks_like=META_FILE, inputs=inputs, option="--save-artifact") as tmp:
        art.save(tmp)
    wide = [i for i, b in enumerate(art.key_bits) if b != art.layout.key.bits] if art.key_bits else []
    print(f"calibrated in {time.perf_counter() - t1:.0f} s; artifact saved to {out}/ ({len(wide)} of {art.num_layers} "
          f"layers with 4-bit keys, pages {art.bits_per_element():.2f} bits/element) — the next commands read it: "
          f"oscar-export inspect {out}/, oscar-export generate --artifact {out}/")
    return art


__all__ = ["EPILOG", "add_arguments", "build_methods", "calibrate_and_save", "check_device", "check_lengths", "run",
           "run_eval"]
