"""Wall time of ``oscar-export calibrate --model default`` (SmolLM2-135M) on this machine.

Runs the real command in-process, then prints one markdown row: tokens, total seconds (model load
included), capture / fit split from the artifact, the held-out error ratios, the CPU count and the load
average before and after (the development machine is shared: a high load means the time is inflated), the
torch version and git SHA. ``--record`` appends the row to ``benchmarks/RESULTS-calibrate.md``.

    python benchmarks/calibrate_time.py --tokens 20000 --record
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from oscar_export.calibration.artifact import load_artifact
from oscar_export.cli import main

RESULTS = Path(__file__).with_name("RESULTS-calibrate.md")
HEADER = (
    "| date (UTC) | git | tokens | seq_len | keys | total s | load s | capture s | fit s | K/id | V/id | K/had | V/had "
    "| CPUs | load avg before→after | torch |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main_bench() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--key-granularity", default=None)
    p.add_argument("--record", action="store_true", help=f"append the row to {RESULTS.name}")
    p.add_argument("--keep", default=None, help="also copy the artifact to this directory")
    a = p.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        argv = ["calibrate", "--model", "default", "--out", out, "--tokens", str(a.tokens), "--seq-len", str(a.seq_len)]
        if a.key_granularity:
            argv += ["--key-granularity", a.key_granularity]
        t0 = time.perf_counter()
        rc = main(argv)
        total = time.perf_counter() - t0
        if rc != 0:
            return rc
        art = load_artifact(out)
        if a.keep:
            art.save(a.keep)
    load_after = os.getloadavg()[0]
    st, layers = art.stats, art.stats["layers"]
    mean = lambda side, key: sum(x[side][key] for x in layers) / len(layers)  # noqa: E731
    row = (
        f"| {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} | {git_sha()} | {a.tokens} | {a.seq_len} | "
        f"{art.layout.key.granularity} | {total:.1f} | {st.get('seconds_load', 0):.1f} | {st['seconds_capture']:.1f} | "
        f"{st['seconds_fit']:.1f} | {mean('k', 'vs_identity'):.3f} | {mean('v', 'vs_identity'):.3f} | "
        f"{mean('k', 'vs_hadamard'):.3f} | {mean('v', 'vs_hadamard'):.3f} | {os.cpu_count()} | "
        f"{load_before:.1f}→{load_after:.1f} | {torch.__version__} |"
    )
    print(HEADER + row)
    for side in "kv":
        base = {n: sum(x[side]["baselines"][n] for x in layers) for n in layers[0][side]["baselines"]}
        ours = sum(x[side]["error"] for x in layers)
        print(f"{side.upper()} held-out error summed over layers: ours {ours:.4g}; "
              + ", ".join(f"{n} {v:.4g}" for n, v in base.items()))
    if a.record:
        text = RESULTS.read_text() if RESULTS.exists() else "# `oscar-export calibrate` wall time (SmolLM2-135M, CPU)\n\n"
        if HEADER.splitlines()[0] not in text:
            RESULTS.write_text(text + HEADER)
        with RESULTS.open("a") as f:
            f.write(row + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_bench())
