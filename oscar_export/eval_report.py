"""The evaluation's outputs: a markdown table, a JSON file and PNG plots (KL and NIAH accuracy vs bits)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if abs(x) >= 10 ** -nd or x == 0 else f"{x:.2e}"
    return str(x)


def markdown(result: dict) -> str:
    """The results table (one row per method) plus the NIAH table and the protocol notes."""
    methods = result["methods"]
    lengths = result["niah"]["config"]["lengths"] if result.get("niah") else []
    text = result.get("text") or {}
    tl = text.get("length")
    lines = []
    bits_cols = [tl] if tl else []
    bits_cols += [L for L in lengths if L != tl]
    head = ["method"] + [f"bits@{L}" for L in bits_cols]
    if text:
        head += ["PPL", "ΔPPL", "ΔPPL %", "KL", "KL beyond windows", "top-1"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    base_ppl = text.get("scores", {}).get("bf16", {}).get("ppl") if text else None
    for m in methods:
        row = [m["name"]] + [_f(m["bits"].get(str(L)), 3) for L in bits_cols]
        if text:
            s = text["scores"].get(m["name"], {})
            ppl = s.get("ppl")
            dppl = ppl - base_ppl if ppl is not None and base_ppl else None
            rel = 100 * dppl / base_ppl if dppl is not None else None
            row += [_f(ppl, 3), _f(dppl, 3), _f(rel, 2), _f(s.get("kl"), 4), _f(s.get("kl_beyond_windows"), 4),
                    _f(s.get("top1"), 4)]
        lines.append("| " + " | ".join(row) + " |")
    if result.get("niah"):
        summ = result["niah"]["summary"]
        kinds = sorted({k for v in summ.values() for k in v})
        head = ["method"] + [f"{k} @{L}" for k in kinds for L in lengths]
        lines += ["", "NIAH accuracy (correct / asked):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for m in methods:
            row = [m["name"]]
            for k in kinds:
                for L in lengths:
                    c = summ.get(m["name"], {}).get(k, {}).get(str(L))
                    row.append(f"{round(c['acc'] * c['n'])}/{c['n']}" if c else "–")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Methods:", ""] + [f"- `{m['name']}`: {m['description']}" for m in methods]
    return "\n".join(lines) + "\n"


def plots(result: dict, out_dir: Path) -> list[Path]:
    """``kl_vs_bits.png`` and ``niah_vs_bits.png`` in ``out_dir``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    methods = [m for m in result["methods"] if m["name"] != "bf16"]
    text = result.get("text")
    if text:
        tl = str(text["length"])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in methods:
            s = text["scores"].get(m["name"])
            if s:
                ax.scatter(m["bits"][tl], s["kl"], s=40)
                ax.annotate(m["name"], (m["bits"][tl], s["kl"]), fontsize=8, xytext=(4, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel(f"bits per K/V element at {tl} tokens (windows included)")
        ax.set_ylabel("mean KL(p_bf16 || p_method), nats")
        ax.set_title("Decode-as-deployed KL vs cache bits")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / "kl_vs_bits.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    if result.get("niah"):
        summ = result["niah"]["summary"]
        lengths = result["niah"]["config"]["lengths"]
        fig, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 4), squeeze=False)
        for ax, L in zip(axes[0], lengths):
            for m in result["methods"]:
                accs = [c["acc"] for c in (summ.get(m["name"], {}).get(k, {}).get(str(L)) for k in ("multi", "single")) if c]
                ns = [c["n"] for c in (summ.get(m["name"], {}).get(k, {}).get(str(L)) for k in ("multi", "single")) if c]
                if ns:
                    acc = sum(a * n for a, n in zip(accs, ns)) / sum(ns)
                    ax.scatter(m["bits"][str(L)], 100 * acc, s=40)
                    ax.annotate(m["name"], (m["bits"][str(L)], 100 * acc), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
            ax.set_title(f"NIAH @ {L} tokens")
            ax.set_xlabel("bits per element")
            ax.set_ylabel("accuracy %")
            ax.set_ylim(-5, 105)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / "niah_vs_bits.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def merge(old: dict, new: dict) -> dict:
    """``new`` plus the methods of ``old`` it lacks (same text windows and NIAH config required).

    Lets a later run add methods (e.g. ours, once calibrated) to an earlier one; BF16 is recomputed by
    every run, and a mismatch of its scores means the two runs are not comparable.
    """
    out = json.loads(json.dumps(new, default=str))
    have = {m["name"] for m in out["methods"]}
    out["methods"] += [m for m in old["methods"] if m["name"] not in have]
    for part in ("text", "niah"):
        if part not in old:
            continue
        if part not in out:
            out[part] = old[part]
            continue
        if part == "text":
            for k in ("length", "windows", "source"):
                if old["text"].get(k) != out["text"].get(k):
                    raise ValueError(f"merge: text {k} differs: {old['text'].get(k)!r} vs {out['text'].get(k)!r}")
            a, b = old["text"]["scores"].get("bf16"), out["text"]["scores"].get("bf16")
            if a and b and abs(a["ppl"] - b["ppl"]) > 1e-6 * a["ppl"]:
                raise ValueError(f"merge: BF16 perplexity differs between the runs ({a['ppl']} vs {b['ppl']})")
            out["text"]["scores"] = {**old["text"]["scores"], **out["text"]["scores"]}
        else:
            if old["niah"]["config"] != out["niah"]["config"]:
                raise ValueError("merge: NIAH configs differ")
            names = set(out["niah"].get("methods", []))
            out["niah"]["rows"] += [r for r in old["niah"]["rows"] if r["method"] not in names]
            out["niah"]["methods"] = sorted(names | set(old["niah"].get("methods", [])))
            from .niah import summarize

            out["niah"]["summary"] = summarize(out["niah"]["rows"])
    out.setdefault("merged_from", []).append(old.get("command", "?"))
    return out


def write_all(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """``results.json``, ``results.md`` and the plots in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(result, indent=1, default=str))
    paths["markdown"].write_text(markdown(result))
    for p in plots(result, out):
        paths[p.stem] = p
    return paths


__all__ = ["markdown", "merge", "plots", "write_all"]
