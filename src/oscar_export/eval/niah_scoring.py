"""Needle in a haystack: the score of an answer and of a set of answers.

Exact match: the first number of the answer equals the value (``single``/``multikey``), every value appears among
the answer's numbers (``multivalue``); RULER's recall counts the values found. Counts come with 95 % Wilson
intervals.
"""

from __future__ import annotations

import math
import re

from .niah_prompts import NiahPrompt

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95 % Wilson score interval of ``k`` successes in ``n`` trials (``(nan, nan)`` for n = 0). It holds ``k / n``
    exactly, whatever the rounding (``mid - half`` at ``k = 0`` comes out a few ulps above 0 for some ``n``)."""
    if n <= 0:
        return float("nan"), float("nan")
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return min(p, max(0.0, mid - half)), max(p, min(1.0, mid + half))


def numbers(text: str) -> tuple[list[str], str]:
    """``(complete numbers, trailing digits)``: digit runs followed by something else, and the run still open."""
    runs = [(m.group(0), m.end()) for m in re.finditer(r"\d+", text)]
    if runs and runs[-1][1] == len(text):
        return [r for r, _ in runs[:-1]], runs[-1][0]
    return [r for r, _ in runs], ""


def judge(prompt: NiahPrompt, text: str, finished: bool = True) -> tuple[bool, bool]:
    """``(done, ok)`` for the answer decoded so far (``finished``: no more tokens will come)."""
    done_nums, open_run = numbers(text)
    if prompt.task != "multivalue":
        value = prompt.values[0]
        stripped = text.lstrip()
        if done_nums and stripped.startswith(done_nums[0]):
            return True, done_nums[0] == value
        if open_run and stripped == open_run:
            wrong = not value.startswith(open_run)
            return wrong or finished, (not wrong) and open_run == value and finished
        return bool(stripped) or finished, False  # an answer that does not start with a number is wrong
    got = set(done_nums + ([open_run] if finished and open_run else []))
    ok = all(v in got for v in prompt.values)
    return ok or finished or "\n\n" in text or len(done_nums) >= len(prompt.values), ok


def values_found(prompt: NiahPrompt, text: str) -> int:
    """How many of the asked values appear among the answer's numbers (RULER's ``string_match_all`` counts)."""
    done_nums, open_run = numbers(text)
    got = set(done_nums + ([open_run] if open_run else []))
    return sum(v in got for v in prompt.values)


def result_row(pr: NiahPrompt, method: str, answer: str) -> dict:
    _, ok = judge(pr, answer, finished=True)
    return {"task": pr.task, "length": pr.length, "index": pr.index, "depth": round(pr.depth, 4),
            "prompt_tokens": len(pr.ids), "needle_at": pr.needle_at, "values": pr.values, "method": method,
            "answer": answer, "ok": ok, "found": values_found(pr, answer)}


def summarize(rows: list[dict]) -> dict:
    """``{method: {task: {length: {ok, n, acc, lo, hi, found, asked, recall, recall_lo, recall_hi}}}}``.

    ``ok``/``n``: exact answers (every value, for multivalue) with the 95 % Wilson interval ``lo``/``hi``;
    ``found``/``asked``: values recalled (RULER's multivalue score), Wilson over values (values of one prompt
    are correlated: that interval is narrower than the truth).
    """
    counts: dict = {}
    for r in rows:
        c = counts.setdefault(r["method"], {}).setdefault(r["task"], {}).setdefault(str(r["length"]), [0, 0, 0, 0])
        c[0] += int(r["ok"])
        c[1] += 1
        c[2] += int(r.get("found", int(r["ok"])))
        c[3] += len(r.get("values", [None]))
    out: dict = {}
    for m, tasks in counts.items():
        for t, lens in tasks.items():
            for L, (k, n, f, a) in lens.items():
                lo, hi = wilson(k, n)
                rlo, rhi = wilson(f, a)
                out.setdefault(m, {}).setdefault(t, {})[L] = {"ok": k, "n": n, "acc": k / n, "lo": lo, "hi": hi,
                                                             "found": f, "asked": a, "recall": f / a,
                                                             "recall_lo": rlo, "recall_hi": rhi}
    return out


__all__ = ["Z95", "judge", "numbers", "result_row", "summarize", "values_found", "wilson"]
