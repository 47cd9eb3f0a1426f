"""Evaluate KV-cache methods decode-as-deployed: PPL, KL, top-1, NIAH, bits per element.

Calibrates OSCAR on the model (unless --artifact is given), builds the baselines (BF16, naive INT2,
QuaRot-INT2, KIVI-2 at its defaults and at our budget, transformers' QuantizedCache with HQQ and quanto,
the OSCAR research recipe) and scores them all on the same text and needles. Every quality number comes
from what decode sees: each position reads the BF16 windows relative to itself and INT2 everywhere else.
Writes results.md, results.json and PNG plots to --out.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch

EPILOG = """examples:
  oscar-export eval --model default                  # the main job: calibrate, evaluate, print the table
  oscar-export eval --model default --quick          # CI preset (a few minutes on 2 CPUs)
  oscar-export eval --model default --artifact art/ --methods bf16,oscar,kivi2 --no-niah
"""


@dataclass(frozen=True)
class Preset:
    """Args: text_length/text_windows (PPL/KL text), niah lengths, needles per length band, single-needle
    haystacks, calibration tokens, research-recipe capture tokens, and whether the HF QuantizedCache
    replay runs unless named in --methods (HQQ re-optimises the whole history at every flush: minutes)."""

    text_length: int
    text_windows: int
    niah_lengths: tuple[int, ...]
    needles_per_length: int
    single_haystacks: int
    calib_tokens: int
    research_tokens: int
    hf_methods: bool = True

    def __post_init__(self) -> None:
        if self.text_length < 2 or self.text_windows < 1 or self.calib_tokens < 1 or self.research_tokens < 1:
            raise ValueError(f"Preset: invalid sizes {self}")


PRESETS = {
    "quick": Preset(1024, 1, (1024,), 2, 0, 4096, 1024, hf_methods=False),
    # The README's main job: sized to finish in < 15 min on a 2-core CPU (the HF QuantizedCache replay alone
    # takes ~20 min there: it is in "full" or named with --methods).
    "default": Preset(1024, 1, (1024, 2048), 1, 0, 8192, 2048, hf_methods=False),
    "full": Preset(2048, 4, (1024, 2048, 4096, 8192), 4, 2, 20_000, 4096),
}


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M) or a local HF model dir")
    p.add_argument("--artifact", default=None, help="calibrated artifact directory (default: calibrate now)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--quick", action="store_true",
                   help="same as --preset quick (CI; leaves out the HF QuantizedCache replay unless named in --methods)")
    p.add_argument("--methods", default=None, help="comma-separated subset of method names (default: all)")
    p.add_argument("--text-length", type=int, default=None, help="tokens per text window (overrides the preset)")
    p.add_argument("--text-windows", type=int, default=None, help="text windows (overrides the preset)")
    p.add_argument("--niah-lengths", default=None, help="comma-separated NIAH lengths (overrides the preset)")
    p.add_argument("--needles-per-length", type=int, default=None, help="multi-key needles per length band (preset)")
    p.add_argument("--single-haystacks", type=int, default=None, help="single-needle haystacks (overrides the preset)")
    p.add_argument("--no-niah", action="store_true", help="skip needle-in-a-haystack")
    p.add_argument("--no-text", action="store_true", help="skip PPL/KL/top-1")
    p.add_argument("--niah-hf", action="store_true",
                   help="also run NIAH for the HF QuantizedCache methods (HQQ re-optimises the whole prompt "
                        "for every question and layer: ~30 s per question on a 2-core CPU)")
    p.add_argument("--out", default="eval_out", help="output directory (default: eval_out/)")
    p.add_argument("--merge", default=None, metavar="RESULTS_JSON",
                   help="add the methods of an earlier results.json (same text and NIAH settings) to this run's")


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)


def _calibrate(model, tok, tokens: int, log):
    try:
        from oscar_export.calibration.pipeline import CalibrationConfig, calibrate
    except ImportError as e:
        raise ImportError(f"eval needs oscar_export.calibration to calibrate (or pass --artifact): {e}") from e
    cfg = CalibrationConfig(tokens=tokens)
    log(f"calibrating OSCAR on {tokens} tokens of calibration text ...")
    return calibrate(model, tok, cfg)


def _load_artifact(path: str, model):
    from oscar_export.calibration.artifact import load_artifact

    return load_artifact(path, model.config)


def run_eval(model, tok, preset: Preset, artifact=None, names: list[str] | None = None, niah: bool = True,
             text: bool = True, niah_hf: bool = False, log=print) -> dict:
    """Build every method, score them, return the JSON-able result dict."""
    from .eval_metrics import TextScore, compare_hidden, final_hidden, text_windows
    from .eval_methods import Method
    from .eval_recipes import attention_shape, baseline_methods, ours_method, research_recipe
    from .niah import NiahConfig, run_niah, summarize

    t_start = time.perf_counter()
    attention_shape(model)
    if text:
        windows = text_windows(tok, preset.text_length, preset.text_windows)  # fails early if too short
    timings = {}
    methods: list[Method] = baseline_methods(model, artifact.layout if artifact is not None else None)
    want = set(names) if names else None
    if want is None or "oscar-research" in want:
        from .eval_metrics import calibration_text

        t0 = time.perf_counter()
        ids = tok(calibration_text(), return_tensors="pt", add_special_tokens=False).input_ids[0]
        seq = 512
        n = max(1, preset.research_tokens // seq)
        methods.append(research_recipe(model, ids[: n * seq].view(n, seq)))
        timings["research_capture_s"] = round(time.perf_counter() - t0, 1)
    if artifact is not None:
        methods.append(ours_method(artifact))
    if want is not None:
        unknown = want - {m.name for m in methods}
        if unknown:
            raise ValueError(f"--methods: unknown {sorted(unknown)}; available: {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in want or m.name == "bf16"]
    elif not preset.hf_methods:
        methods = [m for m in methods if m.kind != "hf"]
    lengths = sorted({preset.text_length, *preset.niah_lengths})
    result = {
        "methods": [{"name": m.name, "kind": m.kind, "description": m.description,
                     "bits": {str(L): m.bits_per_element(L) for L in lengths}} for m in methods],
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": __import__("transformers").__version__, "machine": platform.machine(),
                        "cpus": torch.get_num_threads()},
        "protocol": "decode-as-deployed fake quantization inside attention (oscar_export.eval_attention); "
                    "every row rounded to bfloat16 before storage/quantization; model computes in float32",
    }
    if artifact is not None:
        result["artifact"] = {"config": getattr(artifact, "config", {}), "layout": artifact.layout.to_dict()}
    if text:
        t0 = time.perf_counter()
        lay = methods[1].layout if len(methods) > 1 and methods[1].layout is not None else None
        beyond = (lay.sink + lay.recent_capacity) if lay is not None else 0
        scores = {m.name: TextScore() for m in methods}
        bar = _progress(len(methods) * windows.shape[0], "text (PPL/KL)")
        for w in windows:
            ref = final_hidden(model, w, methods[0])
            bar.update(1)
            scores["bf16"].add(compare_hidden(model, ref, ref, w, beyond))
            for m in methods[1:]:
                bar.set_postfix_str(m.name)
                scores[m.name].add(compare_hidden(model, ref, final_hidden(model, w, m), w, beyond))
                bar.update(1)
        bar.close()
        result["text"] = {
            "source": "pydoc_data.topics, sorted topics joined by blank lines, last 30% of the characters",
            "length": preset.text_length, "windows": int(windows.shape[0]), "beyond_windows_from": beyond,
            "scores": {k: {**v.summary(), "per_window_kl": v.per_window_kl} for k, v in scores.items()},
        }
        timings["text_s"] = round(time.perf_counter() - t0, 1)
    if niah:
        t0 = time.perf_counter()
        cfg = NiahConfig(lengths=preset.niah_lengths, needles_per_length=preset.needles_per_length,
                         single_haystacks=preset.single_haystacks)
        bar = _progress(0, "NIAH")
        niah_methods = [m for m in methods if niah_hf or m.kind != "hf"]
        rows = run_niah(model, tok, niah_methods, cfg, progress=lambda s: (bar.set_postfix_str(s), bar.update(1)))
        bar.close()
        result["niah"] = {"config": cfg.to_dict(), "summary": summarize(rows), "rows": rows,
                          "methods": [m.name for m in niah_methods]}
        timings["niah_s"] = round(time.perf_counter() - t0, 1)
    timings["total_eval_s"] = round(time.perf_counter() - t_start, 1)
    result["timings"] = timings
    return result


def run(args) -> int:
    from .eval_report import markdown, write_all
    from .models import load_model

    preset = PRESETS["quick" if args.quick else args.preset]
    over = {}
    if args.text_length is not None:
        over["text_length"] = args.text_length
    if args.text_windows is not None:
        over["text_windows"] = args.text_windows
    if args.needles_per_length is not None:
        over["needles_per_length"] = args.needles_per_length
    if args.single_haystacks is not None:
        over["single_haystacks"] = args.single_haystacks
    if args.niah_lengths:
        over["niah_lengths"] = tuple(int(x) for x in args.niah_lengths.split(","))
    if over:
        preset = Preset(**{**preset.__dict__, **over})
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    from .eval_recipes import attention_shape

    attention_shape(model)
    names = [s.strip() for s in args.methods.split(",")] if args.methods else None
    if args.artifact:
        artifact = _load_artifact(args.artifact, model)
    elif names is None or "oscar" in names:
        t1 = time.perf_counter()
        artifact = _calibrate(model, tok, preset.calib_tokens, print)
        print(f"calibrated in {time.perf_counter() - t1:.0f} s")
    else:
        artifact = None
    result = run_eval(model, tok, preset, artifact, names, niah=not args.no_niah, text=not args.no_text,
                      niah_hf=args.niah_hf)
    result["command"] = "oscar-export eval " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())
                                                         if not k.startswith("_"))
    result["preset"] = preset.__dict__
    result["timings"]["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.merge:
        import json
        from pathlib import Path

        from .eval_report import merge

        result = merge(json.loads(Path(args.merge).read_text()), result)
    paths = write_all(result, args.out)
    print(markdown(result))
    for k, p in paths.items():
        print(f"{k}: {p}")
    return 0
