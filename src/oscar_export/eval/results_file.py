"""An earlier ``results.json`` read as input (``eval --merge``): every field the merge and the report read of it,
checked before the evaluation starts, so that a malformed file is one clear error before the work, not a
``TypeError`` after it.

What is checked (``report.merge`` and the tables and plots of ``report.py`` read exactly these)::

    methods            a list of objects, each with strings "name" and "description" and "bits" {length: number}
    text.lengths       {length: {"windows": int, "scores": {method: {field: number or list}}}}    (optional)
    niah               {"config": {"lengths": [int], "tasks": [str], "needles": int, "split": str, ...},
                        "methods": [str], "rows": [{"method": str, "task": str, "length": int, "ok": bool,
                        "found": int, "values": [...], ...}]}  (optional; its summary is recomputed from the rows)
    timings            an object                                                             (optional)
"""

from __future__ import annotations

from typing import Any

from .niah_prompts import TASKS


class ResultsError(ValueError):
    """An earlier results.json that ``eval --merge`` cannot read."""


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _need(ok: bool, where: str, expected: str, got: Any) -> None:
    if not ok:
        shown = type(got).__name__ if isinstance(got, (dict, list)) else repr(got)[:80]
        raise ResultsError(f"{where}: expected {expected}, got {shown}")


def _object(x: Any, where: str) -> dict:
    _need(isinstance(x, dict), where, "an object", x)
    return x


def _check_methods(methods: Any) -> None:
    _need(isinstance(methods, list), "methods", "a list", methods)
    for i, m in enumerate(methods):
        _object(m, f"methods[{i}]")
        for key in ("name", "description"):
            _need(isinstance(m.get(key), str), f"methods[{i}].{key}", "a string", m.get(key))
        bits = _object(m.get("bits"), f"methods[{i}].bits")
        for L, b in bits.items():
            _need(_number(b), f"methods[{i}].bits[{L!r}]", "a number", b)


def _check_text(text: Any) -> None:
    lengths = _object(_object(text, "text").get("lengths"), "text.lengths")
    for L, part in lengths.items():
        where = f"text.lengths[{L!r}]"
        _need(L.isdigit(), where, "a length in tokens as the key", L)
        _object(part, where)
        _need(type(part.get("windows")) is int, f"{where}.windows", "an int", part.get("windows"))
        for name, score in _object(part.get("scores"), f"{where}.scores").items():
            for k, v in _object(score, f"{where}.scores[{name!r}]").items():
                ok = _number(v) or isinstance(v, list) and all(_number(x) for x in v)
                _need(ok, f"{where}.scores[{name!r}].{k}", "a number or a list of numbers", v)


def _check_niah(niah: Any) -> None:
    _object(niah, "niah")
    cfg = _object(niah.get("config"), "niah.config")
    lengths, tasks = cfg.get("lengths"), cfg.get("tasks")
    _need(isinstance(lengths, list) and bool(lengths) and all(type(x) is int for x in lengths), "niah.config.lengths",
          "a list of ints", lengths)
    _need(isinstance(tasks, list) and all(t in TASKS for t in tasks), "niah.config.tasks", f"tasks of {list(TASKS)}",
          tasks)
    _need(type(cfg.get("needles")) is int, "niah.config.needles", "an int", cfg.get("needles"))
    _need(isinstance(cfg.get("split"), str), "niah.config.split", "a string", cfg.get("split"))
    names = niah.get("methods")
    _need(isinstance(names, list) and all(isinstance(n, str) for n in names), "niah.methods", "a list of strings",
          names)
    rows = niah.get("rows")
    _need(isinstance(rows, list), "niah.rows", "a list", rows)
    for i, r in enumerate(rows):
        _object(r, f"niah.rows[{i}]")
        for key, ok, what in (("method", isinstance(r.get("method"), str), "a string"),
                              ("task", r.get("task") in TASKS, f"one of {list(TASKS)}"),
                              ("length", type(r.get("length")) is int, "an int"),
                              ("ok", isinstance(r.get("ok"), bool), "true or false"),
                              ("found", type(r.get("found", 0)) is int, "an int"),
                              ("values", isinstance(r.get("values", []), list), "a list")):
            _need(ok, f"niah.rows[{i}].{key}", what, r.get(key))


def check_results(data: Any) -> dict:
    """``data`` (an earlier ``results.json``, parsed) if ``report.merge`` and the report can read it; else one
    :class:`ResultsError` naming the first field that is not what they read."""
    _object(data, "the file")
    _check_methods(data.get("methods"))
    if "text" in data:
        _check_text(data["text"])
    if "niah" in data:
        _check_niah(data["niah"])
    if "timings" in data:
        _object(data["timings"], "timings")
    return data


__all__ = ["ResultsError", "check_results"]
