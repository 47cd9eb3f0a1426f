"""Time of the default calibration (``CalibrationConfig.recipe``: 4-bit keys under a 3.0 page-bit budget).

Two modes:

* default: ``oscar-export calibrate --model default`` (SmolLM2-135M) run in-process on this machine; prints one
  markdown row: total seconds (model load included), the capture / fit / key-bits split from the artifact, the
  process CPU seconds (the development machine is shared: its load average before and after is in the row; CPU
  time says what the run itself cost), the held-out error ratios, the layers given 4-bit keys, torch and git
  SHA. ``--record`` appends the row to ``benchmarks/RESULTS-calibrate.md``.
* ``--shape llama3-8b --device cuda``: a random-weight model of the Llama-3-8B shape (32 layers, hidden 4096,
  32 query / 8 KV heads of 128, MLP 14336, vocab 128256) built in BF16 on the GPU, calibrated with the same
  recipe (capture on the GPU, fit on the CPU threads); prints the times and the peak GPU memory torch allocated
  as JSON (``--json`` writes it). Random weights: time and memory only, never accuracy. ``--shape tiny
  --device cpu`` runs the same path at toy size (a smoke test).

    python benchmarks/calibrate_time.py --record
    python benchmarks/calibrate_time.py --shape llama3-8b --device cuda --json calibrate_8b.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from oscar_export.bench import ByteTokenizer, git_commit

RESULTS = Path(__file__).with_name("RESULTS-calibrate.md")
HEADER = (
    "| date (UTC) | git | tokens | seq_len | budget | 4-bit key layers | total s | load s | capture s | fit s "
    "| key bits s | CPU s (capture / fit / key bits) | K/id | V/id | CPUs "
    "| load avg before→after | torch |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)
SHAPES = {  # layers, hidden, query heads, KV heads, head_dim, MLP, vocab
    "llama3-8b": (32, 4096, 32, 8, 128, 14336, 128256),
    "tiny": (2, 64, 4, 2, 32, 96, 256),
}


def smollm2(a) -> int:
    from oscar_export.calibration.artifact import load_artifact
    from oscar_export.cli import main

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        argv = ["calibrate", "--model", "default", "--out", out, *a.extra]
        t0, c0 = time.perf_counter(), time.process_time()
        rc = main(argv)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        if rc != 0:
            return rc
        art = load_artifact(out)
        if a.keep:
            art.save(a.keep)
    load_after = os.getloadavg()[0]
    st, layers = art.stats, art.stats["layers"]
    cfg = art.config
    mean = lambda side, key: sum(x[side][key] for x in layers) / len(layers)  # noqa: E731
    wide = [i for i, b in enumerate(art.key_bits) if b != art.layout.key.bits]
    sha = git_commit(Path(__file__).parent) or "?"
    row = (
        f"| {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} | {sha} | {cfg['tokens']} | {cfg['seq_len']} | "
        f"{cfg['key_bits_budget']} | {wide} | {total:.1f} | {st.get('seconds_load', 0):.1f} | "
        f"{st['seconds_capture']:.1f} | {st['seconds_fit']:.1f} | {st.get('seconds_key_bits', 0):.1f} | {cpu:.1f} "
        f"({' / '.join(str(st.get('cpu_seconds', {}).get(k, '?')) for k in ('capture', 'fit', 'key_bits'))}) | "
        f"{mean('k', 'vs_identity'):.3f} | {mean('v', 'vs_identity'):.3f} | {os.cpu_count()} | "
        f"{load_before:.1f}→{load_after:.1f} | {torch.__version__} |"
    )
    print(HEADER + row)
    if a.record:
        text = RESULTS.read_text() if RESULTS.exists() else "# `oscar-export calibrate` time (SmolLM2-135M, CPU)\n\n"
        if HEADER.splitlines()[0] not in text:
            RESULTS.write_text(text + "\n" + HEADER)
        with RESULTS.open("a") as f:
            f.write(row + "\n")
    return 0


def random_shape(a) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar_export.calibration.config import CalibrationConfig
    from oscar_export.calibration.pipeline import calibrate

    layers, hidden, heads, kv, hd, mlp, vocab = SHAPES[a.shape]
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=hd, intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(a.device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()  # random init where it runs: nothing read from disk
    t_build = time.perf_counter() - t0
    recipe = CalibrationConfig.recipe() if a.shape != "tiny" else CalibrationConfig.recipe(
        tokens=6 * 512, seq_len=512, sink=16, window=32, page_size=32, heldout=2)
    c0 = time.process_time()
    art = calibrate(model, ByteTokenizer(vocab), recipe, fit_threads=None)  # every core of the GPU host
    res = {
        "shape": dict(zip(("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"),
                          SHAPES[a.shape])),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "dtype": str(dtype),
        "cpu_threads": torch.get_num_threads(), "seconds_build": round(t_build, 1),
        **{k: art.stats[k] for k in ("seconds_capture", "seconds_fit", "seconds_key_bits", "seconds_total")},
        "process_cpu_s": round(time.process_time() - c0, 1),
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if a.device == "cuda" else None,
        "key_bits_layers": [i for i, b in enumerate(art.key_bits) if b != art.layout.key.bits],
        "page_bits": round(art.bits_per_element(), 3), "config": recipe.to_dict(),
        "git": git_commit(Path(__file__).parent) or "?",
        "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


def main_bench() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a random-weight model of this shape")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", default=None, help="--shape: also write the JSON here")
    p.add_argument("--record", action="store_true", help=f"append the row to {RESULTS.name}")
    p.add_argument("--keep", default=None, help="also copy the artifact to this directory")
    p.add_argument("extra", nargs="*", help="more `calibrate` options (after --)")
    a = p.parse_args()
    return random_shape(a) if a.shape else smollm2(a)


if __name__ == "__main__":
    sys.exit(main_bench())
