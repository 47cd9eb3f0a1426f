"""``oscar_export/eval/results_file.py``: an earlier results.json checked as ``eval --merge`` reads it."""

from __future__ import annotations

import copy
import json

import pytest

from oscar_export.eval.niah_scoring import summarize
from oscar_export.eval.report import merge
from oscar_export.eval.results_file import ResultsError, check_results


def result() -> dict:
    """A small results dict of the shape ``eval`` writes: two methods, text at 1024 tokens, needles."""
    rows = [{"method": m, "task": "single", "length": 1024, "ok": ok, "found": int(ok), "values": ["1"]}
            for m, ok in (("bf16", True), ("a", False))]
    score = {"ppl": 11.0, "kl": 0.1, "top1": 0.9, "positions": 1023, "per_window_kl": [0.1]}
    return {
        "methods": [{"name": n, "kind": "x", "description": n, "bits": {"1024": b}} for n, b in (("bf16", 16.0),
                                                                                                ("a", 3.1))],
        "text": {"lengths": {"1024": {"windows": 1, "scores": {"bf16": {**score, "kl": 0.0}, "a": score}}}},
        "niah": {"config": {"lengths": [1024], "tasks": ["single"], "needles": 1, "split": "report"},
                 "summary": summarize(rows), "rows": rows, "methods": ["bf16", "a"]},
        "timings": {"wall_s": 1.0},
    }


def test_a_results_file_as_eval_writes_it_is_accepted_and_merges():
    old = json.loads(json.dumps(result()))
    assert check_results(old) is old
    merge(old, result())


@pytest.mark.parametrize("edit,where", [
    (lambda r: r.update(methods=[1]), r"methods\[0\]: expected an object, got 1"),
    (lambda r: r["methods"][0].pop("bits"), r"methods\[0\].bits: expected an object"),
    (lambda r: r["text"]["lengths"]["1024"].update(windows="1"), r"text.lengths\['1024'\].windows: expected an int"),
    (lambda r: r["text"]["lengths"]["1024"]["scores"]["a"].update(kl="x"), r"scores\['a'\].kl: expected a number"),
    (lambda r: r["niah"]["config"].update(tasks=["haystack"]), "niah.config.tasks: expected tasks of"),
    (lambda r: r["niah"]["rows"][0].pop("method"), r"niah.rows\[0\].method: expected a string, got None"),
    (lambda r: r["niah"]["rows"][0].update(ok="yes"), r"niah.rows\[0\].ok: expected true or false"),
    (lambda r: r.update(timings=[]), "timings: expected an object, got list"),
])
def test_each_field_the_merge_reads_is_checked(edit, where):
    bad = copy.deepcopy(result())
    edit(bad)
    with pytest.raises(ResultsError, match=where):
        check_results(bad)
