"""Benchmark the INT2 decode-attention kernel against PyTorch SDPA BF16 and the copy roofline (CUDA GPU).

Runs ``benchmarks/bench_decode.py`` of a source checkout (the benchmark scripts are not part of the wheel);
arguments after ``--`` go to it unchanged. Results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EPILOG = """example:
  oscar-export bench                               # the six docs/design.md §6 shapes, token and channel keys
  oscar-export bench -- --shapes 1x8192,8x32768 --variants v3,v4
"""


def add_arguments(p) -> None:
    p.add_argument("args", nargs="*", help="arguments for benchmarks/bench_decode.py (after --)")


def _script() -> Path:
    root = Path(__file__).resolve().parents[1]
    script = root / "benchmarks" / "bench_decode.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"bench: {script} not found; the benchmark runs from a source checkout (pip install -e .)"
        )
    return script


def run(args) -> int:
    import torch

    script = _script()
    if not torch.cuda.is_available():
        raise NotImplementedError("bench: the decode-kernel benchmark needs a CUDA GPU (none visible)")
    spec = importlib.util.spec_from_file_location("oscar_bench_decode", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(list(args.args)) or 0)
