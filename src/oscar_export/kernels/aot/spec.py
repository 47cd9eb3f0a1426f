"""What goes into the kernel bundle: one frozen ``KernelSpec`` per compiled kernel variant.

A spec names a ``@triton.jit`` function by import path (``"oscar_export.kernels.aot.probe:_pack_codes_kernel"``),
its runtime parameters in kernel order with their Triton types, the constexpr values that pick the
variant, ``num_warps``/``num_stages`` and the grid rule. Everything is plain data so the manifest can
record it and a launcher on another machine (or a TensorRT plugin) can rebuild the argument list.

Rules checked here (docs/design.md §3.5):

* runtime scalars are ``i32`` only: Triton's C launcher declares fp32 scalars ``double`` and TensorRT's
  AOT plugins pass int32 extras only, so floats must be constexpr or live in memory;
* pointer parameters are compiled with 16-byte alignment (``tt.divisibility``); launchers must check it;
* the grid rule is three integer expressions over the integer parameters, integer constexprs and the
  spec's ``grid_inputs`` (launch sizes that are not kernel arguments, e.g. the batch ``B``), using
  ``+ - * //``, parentheses, integer literals and ``cdiv(a, b)`` only (evaluated without ``eval``);
* constexprs are int, bool, float or str (a float constexpr such as ``SM_SCALE`` is baked into the binary;
  JSON keeps Python floats exactly).
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from .kernel_plan import KernelPlan
from .rules import evaluate, parse_rule

#: Triton pointer element types a bundle kernel may take.
POINTER_TYPES = ("*fp32", "*fp16", "*bf16", "*u8", "*i8", "*i32", "*i64")
#: runtime scalar types a bundle kernel may take (no floats, see the module doc).
SCALAR_TYPES = ("i32",)
#: bytes of one parameter as the driver sees it.
PARAM_BYTES = {**{t: 8 for t in POINTER_TYPES}, "i32": 4}
#: pointer alignment the bundle is compiled for (torch allocations are 256-byte aligned).
POINTER_ALIGN = 16


@dataclass(frozen=True)
class Param:
    """One runtime kernel parameter: ``name`` as in the kernel signature, ``type`` a Triton type string."""

    name: str
    type: str

    def __post_init__(self) -> None:
        if self.type in ("fp32", "fp16", "bf16", "fp64"):
            raise ValueError(
                f"Param {self.name}: float runtime scalars are not allowed in AOT kernels (got {self.type}); "
                "make it a constexpr or pass it through memory"
            )
        if self.type not in POINTER_TYPES + SCALAR_TYPES:
            raise ValueError(f"Param {self.name}: expected one of {POINTER_TYPES + SCALAR_TYPES}, got {self.type!r}")

    @property
    def is_pointer(self) -> bool:
        return self.type.startswith("*")

    @property
    def nbytes(self) -> int:
        return PARAM_BYTES[self.type]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "bytes": self.nbytes}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel variant of the bundle.

    Args:
        name: bundle-unique variant name (file stem in the bundle), e.g. ``"pack_codes_g64"``.
        kernel: ``"module:attr"`` import path of the ``@triton.jit`` function.
        params: runtime parameters, in the kernel's argument order.
        constexprs: ``(name, value)`` pairs fixing every ``tl.constexpr`` argument (int, bool, float or str).
        grid: three grid-rule expressions (see the module doc).
        grid_inputs: names of launch sizes the grid rule reads besides the kernel's integer arguments.
        num_warps, num_stages: Triton compile options.
        maxnreg: the compiler's register cap per thread (0: none; written to the manifest only when set).
        doc: one line for the manifest/README.
    """

    name: str
    kernel: str
    params: tuple[Param, ...]
    constexprs: tuple[tuple[str, Any], ...]
    grid: tuple[str, str, str]
    num_warps: int = 4
    num_stages: int = 2
    doc: str = ""
    grid_inputs: tuple[str, ...] = ()
    maxnreg: int = 0
    _parsed_grid: tuple[ast.Expression, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(f"KernelSpec.name: expected letters, digits, '_' or '-', got {self.name!r}")
        if ":" not in self.kernel:
            raise ValueError(f"KernelSpec.kernel: expected 'module:attr', got {self.kernel!r}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"KernelSpec.num_warps: expected a power of two <= 32, got {self.num_warps}")
        if self.maxnreg != 0 and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"KernelSpec.maxnreg: expected 0 (none) or 24..255 registers, got {self.maxnreg}")
        if len(self.grid) != 3:
            raise ValueError(f"KernelSpec.grid: expected 3 expressions, got {len(self.grid)}")
        names = [p.name for p in self.params] + [k for k, _ in self.constexprs]
        if len(set(names)) != len(names):
            raise ValueError(f"KernelSpec {self.name}: duplicate parameter names in {names}")
        for k, v in self.constexprs:
            if not isinstance(v, (int, bool, float, str)):
                raise ValueError(
                    f"KernelSpec {self.name}: constexpr {k} must be int, bool, float or str, got {type(v).__name__}"
                )
        if set(self.grid_inputs) & set(names):
            raise ValueError(f"KernelSpec {self.name}: grid_inputs {self.grid_inputs} clash with parameter names")
        ints = {p.name for p in self.params if not p.is_pointer} | set(self.grid_inputs)
        ints |= {k for k, v in self.constexprs if isinstance(v, int) and not isinstance(v, bool)}
        parsed = tuple(_parse_grid_expr(e, ints, self.name) for e in self.grid)
        object.__setattr__(self, "_parsed_grid", parsed)

    @classmethod
    def from_plan(cls, plan: KernelPlan, name: str, constexprs: Mapping[str, Any], maxnreg: int = 0) -> "KernelSpec":
        """The bundle variant ``name`` of a launch plan with these constexpr values (all of the plan's, no more)
        and register cap (``maxnreg``, 0: none)."""
        if set(constexprs) != set(plan.constexprs):
            raise ValueError(f"KernelSpec {name}: constexprs {sorted(constexprs)} are not plan {plan.name}'s "
                             f"{sorted(plan.constexprs)}")
        return cls(name=name, kernel=plan.kernel, params=tuple(Param(n, t) for n, t in plan.params),
                   constexprs=tuple(sorted(constexprs.items())), grid=plan.grid, grid_inputs=plan.sizes,
                   num_warps=plan.num_warps, num_stages=plan.num_stages, doc=plan.doc, maxnreg=maxnreg)

    @property
    def constexpr_dict(self) -> dict[str, Any]:
        return dict(self.constexprs)

    def jit_function(self):
        """Import the ``@triton.jit`` function and check its arguments match this spec, in order."""
        module_name, attr = self.kernel.split(":", 1)
        fn = getattr(importlib.import_module(module_name), attr, None)
        if fn is None or not hasattr(fn, "arg_names"):
            raise ValueError(f"KernelSpec {self.name}: {self.kernel} is not a @triton.jit function")
        runtime = [a for a in fn.arg_names if a not in self.constexpr_dict]
        expected = [p.name for p in self.params]
        if runtime != expected or set(fn.arg_names) != set(expected) | set(self.constexpr_dict):
            raise ValueError(
                f"KernelSpec {self.name}: kernel arguments {list(fn.arg_names)} do not match runtime params "
                f"{expected} + constexprs {sorted(self.constexpr_dict)}"
            )
        return fn

    def signature(self, fn) -> dict[str, str]:
        """Triton ``ASTSource`` signature: every argument in kernel order, constexprs marked."""
        types = {p.name: p.type for p in self.params}
        return {a: types.get(a, "constexpr") for a in fn.arg_names}

    def attrs(self, fn) -> dict[tuple[int, ...], list]:
        """16-byte alignment of every pointer argument (what the JIT would assume for torch tensors)."""
        pointers = {p.name for p in self.params if p.is_pointer}
        return {(i,): [["tt.divisibility", POINTER_ALIGN]] for i, a in enumerate(fn.arg_names) if a in pointers}

    def grid_for(self, values: Mapping[str, int]) -> tuple[int, int, int]:
        """Evaluate the grid rule for the integer parameter and grid-input ``values`` (constexprs are filled in)."""
        env = {k: v for k, v in self.constexprs if isinstance(v, int) and not isinstance(v, bool)}
        env.update(values)
        grid = tuple(int(evaluate(e, env, self.name)) for e in self._parsed_grid)
        if any(g <= 0 for g in grid):
            raise ValueError(f"{self.name}: grid {grid} from {self.grid} has an empty dimension")
        return grid  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kernel": self.kernel,
            "params": [p.to_dict() for p in self.params],
            "constexprs": {k: v for k, v in self.constexprs},
            "grid": list(self.grid),
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "doc": self.doc,
            "grid_inputs": list(self.grid_inputs),
            **({"maxnreg": self.maxnreg} if self.maxnreg else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KernelSpec":
        return cls(
            name=d["name"],
            kernel=d["kernel"],
            params=tuple(Param(p["name"], p["type"]) for p in d["params"]),
            constexprs=tuple(sorted(d["constexprs"].items())),
            grid=tuple(d["grid"]),  # type: ignore[arg-type]
            num_warps=int(d["num_warps"]),
            num_stages=int(d["num_stages"]),
            doc=d.get("doc", ""),
            grid_inputs=tuple(d.get("grid_inputs", ())),
            maxnreg=int(d.get("maxnreg", 0)),
        )


# ---- the grid rule: the launch plan's rule language -----------------------------------------------------


def _parse_grid_expr(expr: str, names: set[str], owner: str) -> ast.Expression:
    return parse_rule(expr, names, f"KernelSpec {owner}: grid expression")


__all__ = ["POINTER_ALIGN", "PARAM_BYTES", "POINTER_TYPES", "SCALAR_TYPES", "KernelSpec", "Param"]
