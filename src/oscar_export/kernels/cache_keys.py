"""Triton cache keys fixed on import, the same in every process whatever kernel launches first.

Triton keys a compiled kernel on disk by, among others, its source hash (``JITFunction.cache_key``), computed on the
kernel's first launch and kept on every helper it reaches. With Triton 3.6 (the GPU image's) the hash depends on that
order: a function's hash takes in the constexpr globals of the helpers hashed *before* it, so a helper reached first
from one kernel and first from another gets two hashes. Reproduced on the CPU with Triton 3.6.0: ``channel_pages``
and, through it, the decode-step append kernel hash differently when the prefill's ``_quant_pack_kernel`` launches
first than when the append kernel does (Triton 3.9 hashes alike). The precompile workers
(``plugins/hf/precompile.py``) launch the append kernel first and a serving process the prefill's quantizer, so
without a fixed key the README loop's first compiled step compiles both append kernels again instead of loading the
workers' ones. :func:`hash_bottom_up`, called by each kernel module on import, hashes every JIT function of the module
after all the helpers it calls: one key per kernel in every process.
"""

from __future__ import annotations

import ast

from triton.runtime.jit import JITFunction


def _callees(fn: JITFunction) -> list[JITFunction]:
    """The JIT functions ``fn``'s source names (bare names and ``module.name`` attributes of its globals)."""
    out = []
    for node in ast.walk(ast.parse(fn.src)):
        value = None
        if isinstance(node, ast.Name):
            value = fn.__globals__.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            value = getattr(fn.__globals__.get(node.value.id), node.attr, None)
        if isinstance(value, JITFunction) and value is not fn:
            out.append(value)
    return out


def hash_bottom_up(namespace: dict) -> None:
    """Compute ``cache_key`` of every JIT function defined in ``namespace`` (a module's globals), each after the
    helpers it calls, transitively."""
    done: set[int] = set()

    def visit(fn: JITFunction) -> None:
        if id(fn) in done:
            return
        done.add(id(fn))
        for callee in _callees(fn):
            visit(callee)
        fn.cache_key

    for value in list(namespace.values()):
        if isinstance(value, JITFunction) and value.__module__ == namespace.get("__name__"):
            visit(value)


__all__ = ["hash_bottom_up"]
