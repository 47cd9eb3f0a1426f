"""The full evaluation protocol (docs/design.md §5) on one GPU (H100 or H200), one command:

    python benchmarks/eval_gpu.py /tmp/smol.gguf --out /tmp/eval_gpu [--artifact art/] [--quick]

1. The embedded SmolLM2-135M (the GGUF given, dequantized) in fp32 on the GPU; every method fake-quantized
   decode-as-deployed on the same text and needles (``oscar_export.eval.driver.run_eval``): text at 2K, 4K
   and 8K (prefixes of 8K windows), NIAH single / multi-key / multi-value at 1K-8K, 20 needles per task and
   length (the ``report`` split), bits per element at each length. The HF ``QuantizedCache`` methods run
   only where ``hqq`` / ``optimum-quanto`` import; otherwise they are listed as not run, with the reason.
2. Ours as deployed (``run_deployed``): the BF16 model with ``enable_oscar(model, artifact, backend="triton")``
   and the real cache, and the fp32 model with the reference backend as the cross-check, on the same
   windows and needles, each against its own model with a plain cache.
3. ``results.json``, ``results.md`` and the PNG plots in ``--out``; progress and phase times on stdout.

Without ``--artifact`` it calibrates on the GPU first (``CalibrationConfig.recipe``, the CLI's default, on at
least 20,000 tokens) and saves the artifact to ``--out/artifact``. ``--quick`` is the same protocol small (a first
run that also times it).
``--device cpu --tiny`` runs every code path at toy sizes on the CPU (the BF16 run then uses the reference
backend: Triton needs CUDA) so that nothing crashes on the GPU for want of a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from oscar_export.bench import git_commit
from oscar_export.eval.deployed import run_deployed
from oscar_export.eval.driver import check_device, check_lengths, run_eval
from oscar_export.eval.presets import PRESETS, Preset
from oscar_export.eval.report import markdown, merge, write_all

QUICK = Preset((2048, 8192), 1, (1024, 8192), 4, 4096, 1024, hf=PRESETS["full"].hf)
TINY = Preset((512,), 1, (512,), 1, 3072, 512, hf=("hf-quanto-int2",), text_chunk=64)


def load_gguf(path: str, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file: {p} does not exist")
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return model.to(device).eval(), tok


def load_earlier(out: Path) -> dict | None:
    """The results an earlier call (other ``--phases``) wrote to ``out``, or None."""
    import json

    p = out / "results.json"
    return json.loads(p.read_text()) if p.is_file() else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("gguf", help="path of SmolLM2-135M-Instruct.Q4_1.gguf (or any Llama-family GGUF)")
    ap.add_argument("--out", default="eval_gpu_out", help="output directory")
    ap.add_argument("--artifact", default=None, help="calibrated artifact directory (default: calibrate here)")
    ap.add_argument("--quick", action="store_true", help="the protocol small: text 2K/8K, NIAH 1K/8K x 4 needles")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU profiling of every code path)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--needles", type=int, default=None, help="NIAH needles per task and length")
    ap.add_argument("--niah-lengths", default=None, help="NIAH lengths, comma-separated (default: the preset's)")
    ap.add_argument("--text-lengths", default=None, help="text lengths, comma-separated (default: the preset's)")
    ap.add_argument("--text-windows", type=int, default=None, help="text windows (of the longest text length)")
    ap.add_argument("--text-chunk", type=int, default=None, help="deployed text: tokens per chunk (1 = decode)")
    ap.add_argument("--methods", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--split", choices=("dev", "report"), default="report")
    ap.add_argument("--no-deployed", action="store_true", help="skip the real-cache runs")
    ap.add_argument("--deployed-parts", default="text,niah", help="what the real-cache runs measure: text and/or niah")
    ap.add_argument("--deployed-runs", default="triton,reference",
                    help="the real-cache runs: triton (BF16 model, as deployed) and/or reference (fp32 cross-check)")
    ap.add_argument("--phases", default="text,niah,deployed",
                    help="comma-separated subset of text, niah, deployed (default: all); results already in "
                         "--out/results.json from an earlier call are kept and merged")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", flush=True)  # noqa: E731
    device = check_device(args.device)
    preset = TINY if args.tiny else QUICK if args.quick else PRESETS["full"]
    over = {k: v for k, v in (("needles", args.needles), ("text_windows", args.text_windows),
                              ("text_chunk", args.text_chunk)) if v is not None}
    if args.text_lengths:
        over["text_lengths"] = tuple(int(x) for x in args.text_lengths.split(","))
    if args.niah_lengths:
        over["niah_lengths"] = tuple(int(x) for x in args.niah_lengths.split(","))
    preset = replace(preset, **over)
    log(f"preset {preset}")
    model, tok = load_gguf(args.gguf, device)
    check_lengths(model, preset, text=True, niah=True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    log(f"model loaded on {device}: {model.config.num_hidden_layers} layers, {params:.0f}M parameters")
    out = Path(args.out)
    if args.artifact:
        from oscar_export.calibration.artifact import load_artifact

        artifact = load_artifact(args.artifact, model.config)
    else:
        from oscar_export.calibration.config import CalibrationConfig
        from oscar_export.calibration.pipeline import calibrate

        log(f"calibrating on {preset.calib_tokens} tokens ...")  # the CLI's default recipe (toy sizes: 2-bit keys)
        cfg = CalibrationConfig(tokens=preset.calib_tokens) if args.tiny else \
            CalibrationConfig.recipe(tokens=max(preset.calib_tokens, 20_000))
        artifact = calibrate(model, tok, cfg)
        artifact.save(out / "artifact")
        log(f"calibrated; artifact saved to {out / 'artifact'}")
    names = [s.strip() for s in args.methods.split(",")] if args.methods else None
    phases = {p.strip() for p in args.phases.split(",")}
    if not phases <= {"text", "niah", "deployed"}:
        raise SystemExit(f"--phases: unknown {sorted(phases - {'text', 'niah', 'deployed'})}")
    if args.no_deployed:
        phases.discard("deployed")
    earlier = load_earlier(out)
    command = "python benchmarks/eval_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)

    def save(result: dict) -> dict:
        """Write what is measured so far (a phase that dies later loses nothing before it)."""
        result.setdefault("command", command)
        result["preset"] = {f.name: getattr(preset, f.name) for f in fields(preset)}
        result["environment"].update(git_sha=git_commit(Path(__file__).parent) or "unknown",
                                     date_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
        merged = merge(earlier, result) if earlier else result
        if earlier and "deployed" in earlier and "deployed" not in merged:
            merged["deployed"] = earlier["deployed"]
        write_all(merged, out)
        return merged

    result = None
    for phase in ("text", "niah"):
        if phase not in phases:
            continue
        # NIAH one named method at a time, each written when done (a time limit loses only the method it cuts)
        groups = [[n] for n in names] if phase == "niah" and names else [names]
        for group in groups:
            part = run_eval(model, tok, preset, artifact, group, split=args.split, log=log,
                            text=phase == "text", niah=phase == "niah")
            part["command"] = command
            result = save(part if result is None else merge(result, part))
            log(f"{phase} phase ({', '.join(group) if group else 'all'}) done: {part['timings']}; written to {out}")
    if result is None:
        if earlier is None:
            raise SystemExit("--phases deployed needs the text/niah results of an earlier call in --out (or "
                             "--phases text,deployed --methods bf16 in one call)")
        result = earlier
    if "deployed" in phases:
        bf16_backend = "triton" if device.type == "cuda" else "torch"
        try:
            for part in [p for p in ("text", "niah") if p in args.deployed_parts.split(",")]:  # each written when done
                result = run_deployed(model, tok, preset, artifact, result, part == "text", part == "niah",
                                      args.split, log=log, bf16_backend=bf16_backend,
                                      runs=tuple(args.deployed_runs.split(",")))
                result = save(result)
                log(f"deployed {part} done: {result['deployed']['timings']}")
        except Exception as e:  # noqa: BLE001 - keep what was measured, say what failed
            import traceback

            traceback.print_exc()
            result["deployed_error"] = f"{type(e).__name__}: {e}"
            log(f"deployed runs FAILED: {result['deployed_error']}")
    result.setdefault("timings", {})[f"wall_s ({args.phases})"] = round(time.perf_counter() - t_start, 1)
    paths = write_all(result, out)
    print(markdown(result))
    for k, p in paths.items():
        print(f"{k}: {p}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
