"""``oscar_export/eval/niah_scoring.py``: the scorer (exact leading number, every value for multivalue) and Wilson
intervals."""

from __future__ import annotations

import pytest

from oscar_export.eval.niah_prompts import NiahPrompt
from oscar_export.eval.niah_scoring import judge, numbers, summarize, values_found, wilson


def prompt(task="single", values=("2531545",)):
    return NiahPrompt(task, 1024, 0, 0.5, "apple", list(values), [], [])


def test_judge_single_exact_leading_number():
    p = prompt()
    assert judge(p, " 2531545.") == (True, True)
    assert judge(p, " 253.") == (True, False)  # truncated
    assert judge(p, " 2531546") == (True, False)
    assert judge(p, " 253", finished=False) == (False, False)  # still a prefix: keep decoding
    assert judge(p, " 254", finished=False) == (True, False)  # no longer a prefix: stop
    assert judge(p, " The number is 2531545.") == (True, False)  # must answer with the number
    assert judge(p, " 25315450") == (True, False)


def test_judge_multivalue_needs_every_value():
    p = prompt("multivalue", ("1111111", "2222222", "3333333"))
    assert judge(p, " 1111111, 3333333, 2222222.") == (True, True)
    assert judge(p, " 1111111, 3333333 and", finished=False) == (False, False)
    assert judge(p, " 1111111, 3333333.") == (True, False)
    assert judge(p, " 1111111, 3333333, 4444444, ", finished=False)[0]  # as many numbers as values: stop
    assert values_found(p, " 1111111, 3333333, 4444444.") == 2
    assert numbers(" 12, 345") == (["12"], "345")


def test_wilson_interval_known_values():
    lo, hi = wilson(10, 20)
    assert lo == pytest.approx(0.2993, abs=1e-4) and hi == pytest.approx(0.7007, abs=1e-4)
    assert wilson(0, 20)[0] == 0 and wilson(0, 20)[1] == pytest.approx(0.1611, abs=1e-4)
    assert wilson(20, 20)[1] == 1 and wilson(20, 20)[0] == pytest.approx(0.8389, abs=1e-4)
    s = summarize([{"method": "m", "task": "single", "length": 1024, "ok": i < 10} for i in range(20)])
    c = s["m"]["single"]["1024"]
    assert (c["ok"], c["n"], c["acc"]) == (10, 20, 0.5) and c["lo"] == pytest.approx(lo)


def test_wilson_interval_holds_the_share_at_0_and_n_of_n():
    """Rounding put the lower bound a few ulps above 0 at 0 of n (n = 3, 6, 7, 12...) and the upper one below 1 at
    n of n (n = 10, 13, 25...): a negative error bar, which the plots refuse."""
    for n in range(1, 301):
        assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0, n
        for k in range(n + 1):
            lo, hi = wilson(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0, (k, n, lo, hi)
