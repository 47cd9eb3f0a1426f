"""One table of the as-deployed accuracy runs: ours through the real cache (``oscar-triton``) beside the BF16
model with its plain cache, from the ``results.json`` files that ``benchmarks/eval_gpu.py`` wrote (the text and
the NIAH parts may come from separate processes), and whether it meets the targets:

    python benchmarks/deployed_table.py /tmp/eg/text4k /tmp/eg/text8k /tmp/eg/niah > table.md

Targets: KL to BF16 <= 0.01 and ΔPPL <= 1 % at every text length; exact answers within one of BF16's in every task
and length (multi-value: every value exact; the values recalled are shown beside, not judged).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KL_MAX, DPPL_MAX, NEEDLE_SLACK = 0.01, 1.0, 1
OURS, BF16 = "oscar-triton", "bf16-plain"


def load(dirs: list[str]) -> tuple[dict, dict, dict, list[str]]:
    """``(text {L: summary}, windows {L: count}, niah summary, sources)`` of ours, gathered over ``dirs``."""
    text, windows, niah, sources = {}, {}, {}, []
    for d in dirs:
        p = Path(d) / "results.json"
        if not p.is_file():
            sources.append(f"{p}: missing (that part did not finish)")
            continue
        r = json.loads(p.read_text())
        dep = r.get("deployed") or {}
        env = r.get("environment", {})
        sources.append(f"{p}: `{r.get('command', '?')}` ({env.get('gpu', env.get('device'))}, torch "
                       f"{env.get('torch')}, triton {env.get('triton')}, commit {env.get('git_sha')}, "
                       f"{env.get('date_utc')} UTC){'; ERROR ' + r['deployed_error'] if 'deployed_error' in r else ''}")
        for L, runs in (dep.get("text") or {}).items():
            if OURS in runs:
                text[int(L)], windows[int(L)] = runs[OURS], dep.get("text_windows")
        if dep.get("niah"):
            niah = dep["niah"]["summary"]
    return text, windows, niah, sources


def k(L: int | str) -> str:
    """``2048`` -> ``"2K"``, ``512`` -> ``"0.5K"``."""
    return f"{int(L) / 1024:g}K"


def niah_cells(niah: dict, method: str, task: str, lengths: list[str]) -> tuple[str, list[int | None]]:
    """The cell (exact answers per length; multi-value also values recalled in brackets) and the exact counts."""
    got = [niah.get(method, {}).get(task, {}).get(L) for L in lengths]
    cell = " / ".join("–" if g is None else f"{g['ok']}" + (f" ({g['found']})" if task == "multivalue" else "")
                      for g in got)
    return cell, [None if g is None else g["ok"] for g in got]


def table(text: dict, windows: dict, niah: dict) -> list[str]:
    lengths = sorted({L for t in niah.get(BF16, {}).values() for L in t}, key=int)
    tasks = [t for t in ("single", "multikey", "multivalue") if t in niah.get(BF16, {})]
    tl = sorted(text)
    head = ["cache"] + [f"{t} {'/'.join(k(L) for L in lengths)}"
                        + (" (values recalled)" if t == "multivalue" else "") for t in tasks]
    head += [f"KL @{'/'.join(k(L) for L in tl)}", f"ΔPPL % @{'/'.join(k(L) for L in tl)}",
             "text windows"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    misses = []
    for method in (BF16, OURS):
        row = [method]
        for t in tasks:
            cell, got = niah_cells(niah, method, t, lengths)
            row.append(cell)
            if method == OURS:
                ref = niah_cells(niah, BF16, t, lengths)[1]
                misses += [f"needles {t} @{L}: {g} vs BF16 {r}" for L, g, r in zip(lengths, got, ref)
                           if g is not None and r is not None and g < r - NEEDLE_SLACK]
        if method == OURS:
            row += [" / ".join(f"{text[L]['kl']:.4f}" for L in tl),
                    " / ".join(f"{text[L]['dppl_pct']:+.2f}" for L in tl), " / ".join(str(windows[L]) for L in tl)]
            misses += [f"KL @{L}: {text[L]['kl']:.4f} > {KL_MAX}" for L in tl if text[L]["kl"] > KL_MAX]
            misses += [f"ΔPPL @{L}: {text[L]['dppl_pct']:+.2f} % > {DPPL_MAX} %" for L in tl
                       if text[L]["dppl_pct"] > DPPL_MAX]
        else:
            row += ["0 (reference)", "0 (reference)", " / ".join(str(windows[L]) for L in tl)]
        lines.append("| " + " | ".join(row) + " |")
    verdict = "targets met" if not misses and text and niah else "MISSED: " + "; ".join(misses or ["parts missing"])
    return lines + ["", f"Targets (KL <= {KL_MAX}, ΔPPL <= {DPPL_MAX} %, needles within {NEEDLE_SLACK} of BF16): "
                        + verdict]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="--out folders of benchmarks/eval_gpu.py runs")
    args = ap.parse_args(argv)
    text, windows, niah, sources = load(args.dirs)
    print("\n".join(table(text, windows, niah) + ["", "Sources:", ""] + [f"- {s}" for s in sources]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
