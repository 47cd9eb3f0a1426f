"""The launch plan's rule language (``launch_plan.py``: grids and derived arguments). No Triton, no torch.

Rules (grid, derived arguments) are integer expressions over the kernel's int32 parameters, its integer
constexprs and the plan's launch ``sizes`` (e.g. the batch ``B``), with ``+ - * //``, parentheses, integer
literals and ``cdiv(a, b)``. :func:`evaluate` runs them on Python ints and on symbolic values that support
``+ * //`` with an int on the right (TensorRT's ``SymInt32`` in ``plugins/trt/plugin.py``).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import Any, Callable, Mapping

_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)


def parse_rule(expr: str, names: set[str] | None, owner: str) -> ast.Expression:
    """Parse a rule; with ``names``, reject any name outside them (``cdiv`` is always allowed)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"{owner}: rule {expr!r} does not parse: {e.msg}") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.BinOp, ast.Load, *_BINOPS))
        ok |= isinstance(node, ast.Constant) and type(node.value) is int
        ok |= isinstance(node, ast.Name) and (names is None or node.id in names or node.id == "cdiv")
        ok |= (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cdiv"
               and len(node.args) == 2 and not node.keywords)
        if not ok:
            raise ValueError(
                f"{owner}: rule {expr!r}: {ast.dump(node)[:60]} is not allowed "
                f"(names {sorted(names or ())}, + - * //, cdiv(a, b))"
            )
    return tree


def evaluate(rule: str | ast.Expression, env: Mapping[str, Any], owner: str = "rule") -> Any:
    """Evaluate a rule over ``env``; ints fold, symbolic values keep an int on the right of ``+ *``."""
    tree = _parsed(rule, owner) if isinstance(rule, str) else rule
    return _eval(tree.body, env, owner)


@lru_cache(maxsize=256)
def _parsed(rule: str, owner: str) -> ast.Expression:
    """:func:`parse_rule` once a rule (the JIT wrappers evaluate the split rules at every launch)."""
    return parse_rule(rule, None, owner)


def _eval(node: ast.AST, env: Mapping[str, Any], owner: str) -> Any:
    if isinstance(node, ast.Constant):
        return int(node.value)
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ValueError(f"{owner}: needs a value for {node.id!r}")
        return env[node.id]
    if isinstance(node, ast.Call):
        a, b = (_eval(x, env, owner) for x in node.args)
        return _binop(ast.FloorDiv(), _binop(ast.Add(), a, _binop(ast.Sub(), b, 1, owner), owner), b, owner)
    assert isinstance(node, ast.BinOp), ast.dump(node)
    return _binop(node.op, _eval(node.left, env, owner), _eval(node.right, env, owner), owner)


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
}


def _binop(op: ast.operator, a: Any, b: Any, owner: str) -> Any:
    if isinstance(a, int) and not isinstance(b, int):
        if isinstance(op, (ast.Add, ast.Mult)):
            a, b = b, a  # symbolic values take ints on the right only
        else:
            raise ValueError(f"{owner}: {type(op).__name__} with an int on the left of a symbolic value")
    return _OPS[type(op)](a, b)


__all__ = ["evaluate", "parse_rule"]
