"""The launch plan's rule language (kernels/aot/rules.py): integer rules evaluated on ints and on symbolic values
that take ints on the right only (TensorRT's ``SymInt32``), and what the language refuses. The plans' own rules:
test_aot_launch_plan.py."""

from __future__ import annotations

import pytest

from oscar_export.kernels.aot.rules import evaluate, parse_rule


class _Sym:
    """A symbolic int as TensorRT's ``SymInt32`` is: ``+ * //`` with an int on the right, nothing else."""

    def __init__(self, text: str):
        self.text = text

    def __add__(self, other: int) -> _Sym:
        assert isinstance(other, int), other
        return _Sym(f"({self.text}+{other})")

    def __mul__(self, other: int) -> _Sym:
        assert isinstance(other, int), other
        return _Sym(f"({self.text}*{other})")

    def __floordiv__(self, other: int) -> _Sym:
        assert isinstance(other, int), other
        return _Sym(f"({self.text}//{other})")


def test_rules_evaluate_on_ints():
    env = {"B": 3, "H_KV": 4, "max_pages": 10, "pages_per_split": 4}
    assert evaluate("B * H_KV", env) == 12
    assert evaluate("cdiv(max_pages, pages_per_split)", env) == 3
    assert evaluate("cdiv(8, 4)", {}) == 2
    assert evaluate("(B + 1) // 2 - 1", env) == 1
    assert evaluate(parse_rule("B * 2 + cdiv(H_KV, 3)", {"B", "H_KV"}, "t"), env) == 8


def test_symbolic_values_take_ints_on_the_right():
    x = _Sym("x")
    assert evaluate("2 * x + 1", {"x": x}).text == "((x*2)+1)"
    assert evaluate("cdiv(x, 4)", {"x": x}).text == "((x+3)//4)"
    with pytest.raises(ValueError, match="int on the left"):
        evaluate("1 - x", {"x": object()})
    with pytest.raises(ValueError, match="int on the left"):
        evaluate("8 // x", {"x": x})


def test_rules_refuse_what_the_language_lacks():
    parse_rule("cdiv(B, 2) * 3 - 1", {"B"}, "t")
    for bad in ("B ** 2", "B * 0.5", "C + 1", "cdiv(B)", "max(B, 2)", "-B", "B if B else 1"):
        with pytest.raises(ValueError, match="is not allowed"):
            parse_rule(bad, {"B"}, "t")
    with pytest.raises(ValueError, match="does not parse"):
        parse_rule("B +", {"B"}, "t")
    with pytest.raises(ValueError, match="needs a value for 'B'"):
        evaluate("B + 1", {})
