"""The evaluation's outputs: markdown tables, a JSON file and PNG plots (KL vs bits, NIAH accuracy vs length).

The result dict (``driver.run_eval``, ``benchmarks/eval_gpu.py``)::

    methods   [{name, kind, description, bits: {length: bits per element}}]
    text      {source, lengths: {length: {windows, scores: {method: TextScore.summary()}}}}
    niah      {config, methods, prompts, summary: {method: {task: {length: {ok, n, acc, lo, hi}}}}, rows}
    deployed  (GPU) {text: {length: {run: scores}}, niah: {summary, rows}, notes}
    skipped   {method: reason}
"""

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


def _count(c: dict | None, task: str = "") -> str:
    if not c:
        return "–"
    cell = f"{c['ok']}/{c['n']} ({100 * c['lo']:.0f}–{100 * c['hi']:.0f})"
    if task == "multivalue" and "found" in c:
        cell += f"; values {c['found']}/{c['asked']}"
    return cell


def text_table(scores: dict, bits: dict, length: int) -> list[str]:
    """One text length: every method's PPL change, KL and top-1 on all positions and on INT2-reading ones."""
    head = ["method", f"bits@{length}", "PPL", "ΔPPL %", "KL", "top-1", "ΔPPL % (INT2)", "KL (INT2)",
            "top-1 (INT2)", "positions (INT2)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in scores.items():
        lines.append("| " + " | ".join([
            name, _f(bits.get(name, {}).get(str(length))), _f(s.get("ppl")), _f(s.get("dppl_pct"), 2),
            _f(s.get("kl"), 4), _f(s.get("top1"), 4), _f(s.get("dppl_pct_q"), 2), _f(s.get("kl_q"), 4),
            _f(s.get("top1_q"), 4), f"{s.get('positions_q', 0)}/{s.get('positions', 0)}",
        ]) + " |")
    return lines


def niah_table(niah: dict, names: list[str]) -> list[str]:
    summ, cfg = niah["summary"], niah["config"]
    cols = [(t, L) for t in cfg["tasks"] for L in cfg["lengths"]]
    head = ["method"] + [f"{t} @{L}" for t, L in cols]
    lines = [
        f"NIAH (split {cfg['split']!r}): {cfg['needles']} needles per task and length, "
        f"{len(cfg['tasks']) * len(cfg['lengths']) * cfg['needles']} questions per method; exact answers "
        "correct/asked (95 % Wilson interval, %); multivalue also values recalled/asked (RULER's score):", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
    ]
    for name in names:
        if name in summ:
            cells = [_count(summ[name].get(t, {}).get(str(L)), t) for t, L in cols]
            lines.append("| " + " | ".join([name] + cells) + " |")
    return lines


TASK_NAMES = {"single": "single needle", "multikey": "multi-key", "multivalue": "multi-value"}


def _order(names: list[str]) -> list[str]:
    """BF16 first, then ours, then the rest as given."""
    first = [n for n in ("bf16", "oscar") if n in names]
    return first + [n for n in names if n not in first]


#: the timed phases of a run (``result["timings"]`` keys) as the first screen names them
PHASES = (("load_s", "model load"), ("calibrate_s", "calibration"), ("methods_s", "peers' setup"), ("text_s", "text"),
          ("niah_s", "needles"))


def headline(result: dict, paths: dict | None = None) -> str:
    """The first screen: what was measured, and one row per method at the longest text length (bits, KL, ΔPPL,
    top-1) with its needles per task summed over the NIAH lengths; then where the plots are."""
    names = _order([m["name"] for m in result["methods"]])
    bits = {m["name"]: m["bits"] for m in result["methods"]}
    env = result.get("environment", {})
    text = (result.get("text") or {}).get("lengths") or {}
    niah = result.get("niah")
    lines = [f"What was measured (decode-as-deployed: every position reads what its cache holds — BF16 sink and "
             f"recent window, INT2 pages between; model on {env.get('device', '?')} in {env.get('dtype', '?')}, "
             f"cache rows rounded to bfloat16):"]
    L = max(text, key=int) if text else None
    if L is not None:
        part = text[L]
        s0 = next(iter(part["scores"].values()))
        q = max((s.get("positions_q", 0) for s in part["scores"].values()), default=0)
        lines.append(f"- text: {part['windows']} window(s) of {int(L):,} tokens of held-out text; for ours "
                     f"{part['scores'].get('oscar', s0).get('positions_q', q):,} of {s0.get('positions', 0):,} "
                     "positions read INT2 history")
    if niah:
        cfg = niah["config"]
        lens = ", ".join(f"{x:,}" for x in cfg["lengths"])
        tasks = ", ".join(TASK_NAMES[t] for t in cfg["tasks"])
        lines.append(f"- needles: {cfg['needles']} per task and length ({tasks}) at {lens} tokens, "
                     f"split {cfg['split']!r}; exact answers")
    tm = result.get("timings") or {}
    if "wall_s" in tm:
        phases = [f"{what} {tm[k]:,.0f} s" for k, what in PHASES if k in tm]
        lines.append(f"- time: {tm['wall_s']:,.0f} s in all ({', '.join(phases)}), {env.get('cpu_threads', '?')} torch "
                     f"thread(s)")
    head = ["method", f"bits/element @{int(L):,}" if L else "bits/element"]
    if L is not None:
        head += ["KL to BF16", "ΔPPL %", "top-1"]
    tasks = niah["config"]["tasks"] if niah else []
    head += [f"{TASK_NAMES[t]} (correct/asked)" for t in tasks]
    where = ""
    if L is not None:
        sc = text[L]["scores"].get("oscar") or max(text[L]["scores"].values(), key=lambda x: x.get("positions_q", 0))
        share = sc.get("positions_q", 0) / max(1, sc.get("positions", 0))
        where = f" ({int(L):,} tokens: {share:.0%} of the positions read INT2 history)"
    lines += ["", f"Where it matters{where}:", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref_len = L or (str(niah["config"]["lengths"][-1]) if niah else None)
    for name in names:
        row = [("**ours (oscar)**" if name == "oscar" else name), _f(bits.get(name, {}).get(str(ref_len)), 2)]
        if L is not None:
            sc = text[L]["scores"].get(name, {})
            row += [_f(sc.get("kl"), 4), _f(sc.get("dppl_pct"), 2), _f(sc.get("top1"), 3)]
        for t in tasks:
            cells = (niah["summary"].get(name) or {}).get(t, {}).values()
            ok, n = sum(c["ok"] for c in cells), sum(c["n"] for c in cells)
            row.append(f"{ok}/{n}" if n else "–")
        if len(row) > 2 and any(c != "–" for c in row[2:]):
            lines.append("| " + " | ".join(row) + " |")
    if result.get("skipped"):
        lines.append(f"\nNot run here: {', '.join(result['skipped'])} (see below).")
    if paths and "summary" in paths:
        lines.append(f"\nAt a glance: {paths['summary']}; every table below and in {paths.get('markdown')}.")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    """Every table of the result (text per length, NIAH, the deployed GPU runs) and the method list."""
    methods = result["methods"]
    bits = {m["name"]: m["bits"] for m in methods}
    if "oscar" in bits:  # the deployed runs store what ours stores
        bits.update({f"oscar-{run}": bits["oscar"] for run in ("triton", "reference")})
    lines: list[str] = []
    text = result.get("text") or {}
    for L, part in (text.get("lengths") or {}).items():
        lines += [f"Text, {part['windows']} window(s) of {L} tokens (decode-as-deployed; INT2 = positions that "
                  "read quantized history):", ""]
        lines += text_table(part["scores"], bits, int(L)) + [""]
    if result.get("niah"):
        lines += niah_table(result["niah"], [m["name"] for m in methods]) + [""]
    dep = result.get("deployed")
    if dep:
        lines += deployed_markdown(dep, bits) + [""]
    if result.get("skipped"):
        lines += ["Not run:", ""] + [f"- `{k}`: {v}" for k, v in result["skipped"].items()] + [""]
    lines += ["Methods:", ""] + [f"- `{m['name']}`: {m['description']}" for m in methods]
    return "\n".join(lines) + "\n"


def deployed_markdown(dep: dict, bits: dict) -> list[str]:
    lines = ["As deployed (real `plugins/hf` cache through `enable_oscar`, text fed in chunks of "
             f"{dep.get('chunk')} tokens):", ""]
    for L, runs in (dep.get("text") or {}).items():
        lines += [f"Text at {L} tokens:", ""] + text_table(runs, bits, int(L)) + [""]
    if dep.get("cross"):
        lines += ["Triton (BF16 model) vs reference (fp32 model) OSCAR runs, KL between them next to each one's "
                  "KL to its own full-precision run:", "", "| length | KL(triton ‖ reference) | KL triton | "
                  "KL reference | KL(bf16 model ‖ fp32 model) |", "|---|---|---|---|---|"]
        for L, c in dep["cross"].items():
            lines.append(f"| {L} | {_f(c.get('kl_triton_vs_reference'), 5)} | {_f(c.get('kl_triton'), 5)} | "
                         f"{_f(c.get('kl_reference'), 5)} | {_f(c.get('kl_model_precision'), 5)} |")
        lines.append("")
    if dep.get("niah"):
        lines += niah_table(dep["niah"], list(dep["niah"]["summary"]))
    return lines


def plots(result: dict, out_dir: Path) -> list[Path]:
    """``kl_vs_bits.png`` (one point per method and text length) and ``niah_vs_length.png`` (accuracy vs
    length per method, one panel per task, Wilson intervals as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    bits = {m["name"]: m["bits"] for m in result["methods"]}
    text = (result.get("text") or {}).get("lengths") or {}
    p = summary_plot(result, out_dir, plt)
    if p is not None:
        paths.append(p)
    if text:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for L, part in text.items():
            for name, s in part["scores"].items():
                if name == "bf16" or not s.get("kl") or str(L) not in bits.get(name, {}):
                    continue
                ax.scatter(bits[name][str(L)], s["kl"], s=30)
                ax.annotate(f"{name}@{L}", (bits[name][str(L)], s["kl"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per K/V element (windows included)")
        ax.set_ylabel("mean KL(p_bf16 || p_method), nats")
        ax.set_title("Decode-as-deployed KL vs cache bits")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(save_figure(fig, out_dir / "kl_vs_bits.png", plt))
    niah_parts = [("niah_vs_length.png", result.get("niah"))]
    if (result.get("deployed") or {}).get("niah"):
        niah_parts.append(("niah_deployed_vs_length.png", result["deployed"]["niah"]))
    for fname, niah in niah_parts:
        if not niah:
            continue
        tasks, lengths = niah["config"]["tasks"], niah["config"]["lengths"]
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for name, per in niah["summary"].items():
                cells = [per.get(task, {}).get(str(L)) for L in lengths]
                xs = [L for L, c in zip(lengths, cells) if c]
                if not xs:
                    continue
                acc = [100 * c["acc"] for c in cells if c]
                err = [[max(0.0, 100 * (c["acc"] - c["lo"])) for c in cells if c],  # a merged file's own bounds
                       [max(0.0, 100 * (c["hi"] - c["acc"])) for c in cells if c]]
                ax.errorbar(xs, acc, yerr=err, marker="o", ms=4, capsize=2, lw=1, label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(L) for L in lengths])
            ax.set_title(f"NIAH {task}")
            ax.set_xlabel("prompt length (tokens)")
            ax.set_ylabel("accuracy % (95 % Wilson)")
            ax.set_ylim(-5, 105)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=6, loc="lower left")
        fig.tight_layout()
        paths.append(save_figure(fig, out_dir / fname, plt))
    return paths


def summary_plot(result: dict, out_dir: Path, plt) -> Path | None:
    """``summary.png``: per method, KL to BF16 at the longest text length (log scale, bits per element in the
    label) and the share of needles answered (every task and length together, 95 % Wilson interval), ours
    highlighted, BF16's needle share as a dashed line."""
    from .niah_scoring import wilson

    names = _order([m["name"] for m in result["methods"]])
    bits = {m["name"]: m["bits"] for m in result["methods"]}
    text = (result.get("text") or {}).get("lengths") or {}
    niah = result.get("niah")
    panels = (["text"] if text else []) + (["niah"] if niah else [])
    if not panels:
        return None
    L = max(text, key=int) if text else str(niah["config"]["lengths"][-1])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 0.45 * len(names) + 1.6), squeeze=False)
    labels = [f"{'ours (oscar)' if n == 'oscar' else n}  {bits.get(n, {}).get(str(L), float('nan')):.2f} b/elt"
              for n in names]
    color = ["tab:red" if n == "oscar" else "tab:gray" if n == "bf16" else "tab:blue" for n in names]
    y = list(range(len(names)))[::-1]
    for ax, kind in zip(axes[0], panels):
        if kind == "text":
            kl = [text[L]["scores"].get(n, {}).get("kl") for n in names]
            pts = [(yy, k, c) for yy, k, c in zip(y, kl, color) if k]  # BF16's 0 has no place on a log axis
            lo = min(p[1] for p in pts) / 4 if pts else 1e-3
            ax.barh([p[0] for p in pts], [p[1] - lo for p in pts], left=lo, color=[p[2] for p in pts])
            ax.set_xscale("log")
            ax.set_xlim(lo, max(p[1] for p in pts) * 4 if pts else 1)
            for yy, k, _ in pts:
                ax.annotate(f"{k:.3g}", (k, yy), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
            if "bf16" in names:
                ax.annotate("0 (the reference)", (lo, y[names.index("bf16")]), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=8)
            ax.set_xlabel(f"KL(p_bf16 || p_method) at {int(L):,} tokens, nats")
            ax.set_title("Text: distance to BF16\nlower is better", fontsize=10)
        else:
            acc, err, counts = [], [[], []], []
            for n in names:
                cells = [c for t in (niah["summary"].get(n) or {}).values() for c in t.values()]
                ok, cnt = sum(c["ok"] for c in cells), sum(c["n"] for c in cells)
                lo, hi = wilson(ok, cnt)
                a = 100 * ok / cnt if cnt else float("nan")
                acc.append(a)
                counts.append(f"{ok}/{cnt}")
                err[0].append(100 * (a / 100 - lo) if cnt else 0)
                err[1].append(100 * (hi - a / 100) if cnt else 0)
            ax.barh(y, acc, xerr=err, color=color, capsize=3)
            for yy, a, c in zip(y, acc, counts):
                ax.annotate(c, (0, yy), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8,
                            color="white" if a > 15 else "black")
            if "bf16" in names and acc[names.index("bf16")] == acc[names.index("bf16")]:
                ax.axvline(acc[names.index("bf16")], color="tab:gray", ls="--", lw=1)
            ax.set_xlim(0, 100)
            tasks = ", ".join(TASK_NAMES[t] for t in niah["config"]["tasks"])
            ax.set_xlabel("needles answered, % (bars: 95 % Wilson interval)")
            ax.set_title(f"Needles at {', '.join(str(x) for x in niah['config']['lengths'])} tokens, higher is "
                         f"better\n{tasks}", fontsize=10)
        ax.set_yticks(y, labels, fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, out_dir / "summary.png", plt)


def merge(old: dict, new: dict) -> dict:
    """``new`` plus the methods of ``old`` it lacks (same text windows and NIAH config required).

    Lets a later run add methods (e.g. ours, once calibrated) to an earlier one; BF16 is recomputed by every
    run, and a mismatch of its perplexity means the two runs are not comparable.
    """
    old, out = (json.loads(json.dumps(d, default=str)) for d in (old, new))  # tuples -> lists, as written
    have = {m["name"] for m in out["methods"]}
    out["methods"] += [m for m in old["methods"] if m["name"] not in have]
    if "text" in old:
        if "text" not in out:
            out["text"] = old["text"]
        else:
            for L, part in old["text"]["lengths"].items():
                mine = out["text"]["lengths"].get(L)
                if mine is None:
                    raise ValueError(f"merge: text length {L} is in the earlier run only")
                if part["windows"] != mine["windows"]:
                    raise ValueError(f"merge: text windows at {L} differ: {part['windows']} vs {mine['windows']}")
                a, b = part["scores"].get("bf16"), mine["scores"].get("bf16")
                if a and b and abs(a["ppl"] - b["ppl"]) > 1e-6 * a["ppl"]:
                    raise ValueError(f"merge: BF16 perplexity differs between the runs ({a['ppl']} vs {b['ppl']})")
                mine["scores"] = {**part["scores"], **mine["scores"]}
    if "niah" in old:
        if "niah" not in out:
            out["niah"] = old["niah"]
        else:
            if old["niah"]["config"] != out["niah"]["config"]:
                raise ValueError("merge: NIAH configs differ")
            names = set(out["niah"]["methods"])
            out["niah"]["rows"] += [r for r in old["niah"]["rows"] if r["method"] not in names]
            out["niah"]["methods"] += [n for n in old["niah"]["methods"] if n not in names]
        from .niah_scoring import summarize

        out["niah"]["summary"] = summarize(out["niah"]["rows"])  # from the rows: the file's own is not trusted
    out["timings"] = {**old.get("timings", {}), **out.get("timings", {})}
    out.setdefault("merged_from", []).append(old.get("command", "?"))
    return out


def save_figure(fig, path: Path, plt) -> Path:
    """``fig`` as a PNG at ``path``, written whole or not at all (``calibration.artifact.write_file_atomic``), then
    closed."""
    import io

    from oscar_export.calibration.artifact import write_file_atomic

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=120)
    finally:
        plt.close(fig)
    return write_file_atomic(path, buf.getvalue())


def write_all(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """``results.json``, ``results.md`` and the plots in ``out_dir``, each file written whole or not at all."""
    from oscar_export.calibration.artifact import write_file_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    write_file_atomic(paths["json"], json.dumps(result, indent=1, default=str).encode())
    write_file_atomic(paths["markdown"], markdown(result).encode())
    for p in plots(result, out):
        paths[p.stem] = p
    return paths


__all__ = ["deployed_markdown", "headline", "markdown", "merge", "niah_table", "plots", "summary_plot", "text_table",
           "write_all"]
