"""Plot decode tokens/s against context, per cache, from ``bench_e2e.py --json`` files (batch-1 rows).

    python benchmarks/plot_e2e.py benchmarks/results/e2e-run2.json benchmarks/results/e2e-run3.json \
        --out benchmarks/results/e2e-tokens-per-s.png
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[str, dict[int, float]] = {}
    env = ""
    for path in args.runs:
        run = json.load(open(path))
        env = run["env"]
        for r in run["rows"]:
            if r.get("B") == 1 and "tokens_per_s" in r:
                points.setdefault(r["cache"], {})[r["context"]] = r["tokens_per_s"]  # later runs win
    fig, ax = plt.subplots(figsize=(6, 4))
    for cache, pts in sorted(points.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", label=cache)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens), batch 1")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Llama-3-8B shape, random BF16 weights", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.text(0.01, 0.01, env, fontsize=6)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
