"""What a launch plan is: ``KernelPlan``, how one kernel is launched, and the rules it evaluates (docs/design.md §3.5).

The serving kernels' plans themselves are ``launch_plan.py``'s (the one statement of them). A plan names a
``@triton.jit`` function, its runtime parameters in launch order with their types, its constexprs, warps and
stages, its grid rule and the int32 arguments derived from others; :meth:`KernelPlan.scalars` and
:meth:`KernelPlan.grid_for` evaluate those rules for a launch. TensorRT's AOT plugins name a plan's tensors
(:func:`tensor_name`) and take its parameters as inputs, int32 extras, outputs (:func:`trt_io`).

Rules (grid, derived arguments) are integer expressions in the language of ``rules.py`` (``+ - * //``, ``cdiv``)
over the kernel's int32 parameters, its integer constexprs and the plan's launch ``sizes`` (e.g. the batch ``B``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .rules import evaluate

#: plugin tensor names that are not the kernel parameter name minus ``_ptr``: the split kernels' ``q_ptr`` is ``q_s``,
#: the step's queries in the stored key basis (fp32, what ``decode_append`` writes to its ``q_rot_ptr``).
TENSOR_NAMES = {"q_ptr": "q_s"}


@dataclass(frozen=True)
class KernelPlan:
    """How one kernel is launched.

    Args:
        name: plan name (``"decode_split"``); bundle variants are ``<name>_<layout tag>``.
        kernel: ``"module:attr"`` of the ``@triton.jit`` function.
        params: ``(name, type)`` runtime parameters in launch order; types are Triton's (``"*bf16"``, ``"i32"``).
        constexprs: names of the constexpr parameters (values: :func:`constexpr_values`).
        num_warps, num_stages: compile/launch options.
        grid: three rule expressions; sizes: launch sizes the rules read that are not kernel arguments.
        derived: ``(param, rule)`` int32 arguments computed from the others, in evaluation order.
    """

    name: str
    kernel: str
    params: tuple[tuple[str, str], ...]
    constexprs: tuple[str, ...]
    num_warps: int
    num_stages: int
    grid: tuple[str, str, str]
    sizes: tuple[str, ...] = ()
    derived: tuple[tuple[str, str], ...] = ()
    doc: str = ""

    @property
    def param_names(self) -> list[str]:
        return [n for n, _ in self.params]

    @property
    def block(self) -> int:
        """Threads per block: 32 x num_warps (what TensorRT's ``block_x`` and ``cuLaunchKernel`` must get)."""
        return 32 * self.num_warps

    def types(self) -> dict[str, str]:
        return dict(self.params)

    def tensor_params(self) -> list[str]:
        return [n for n, t in self.params if t.startswith("*")]

    def scalar_params(self) -> list[str]:
        return [n for n, t in self.params if not t.startswith("*")]

    def scalars(self, given: Mapping[str, Any], constexprs: Mapping[str, Any]) -> dict[str, Any]:
        """All int32 arguments: ``given`` (the host's choices) plus the :attr:`derived` ones, in param order."""
        env = {**_int_constexprs(constexprs), **given}
        for name, rule in self.derived:
            env[name] = evaluate(rule, env, f"{self.name}.{name}")
        missing = [n for n in self.scalar_params() if n not in env]
        if missing:
            raise ValueError(f"{self.name}: no value for int32 arguments {missing}")
        return {n: env[n] for n in self.scalar_params()}

    def grid_for(self, values: Mapping[str, Any], constexprs: Mapping[str, Any]) -> tuple[Any, Any, Any]:
        env = {**_int_constexprs(constexprs), **values}
        return tuple(evaluate(e, env, f"{self.name}.grid") for e in self.grid)  # type: ignore[return-value]


def _int_constexprs(constexprs: Mapping[str, Any]) -> dict[str, int]:
    return {k: v for k, v in constexprs.items() if isinstance(v, int) and not isinstance(v, bool)}


def tensor_name(param: str) -> str:
    """Plugin / ONNX tensor name of a pointer parameter (``q_ptr`` -> ``q_s``, ``k_levels_ptr`` -> ``k_levels``)."""
    return TENSOR_NAMES.get(param, param.removesuffix("_ptr"))


def trt_io(plan: KernelPlan) -> tuple[list[str], list[str], list[str]]:
    """``(input tensors, int32 extras, output tensors)`` of a TensorRT-order plan, as plugin tensor names."""
    names = plan.param_names
    scalars = plan.scalar_params()
    first, last = names.index(scalars[0]), names.index(scalars[-1])
    if names[first : last + 1] != scalars or last == len(names) - 1:
        raise ValueError(f"{plan.name}: not in TensorRT order (inputs, int32 extras, outputs): {names}")
    return ([tensor_name(n) for n in names[:first]], scalars, [tensor_name(n) for n in names[last + 1 :]])


__all__ = ["KernelPlan", "TENSOR_NAMES", "tensor_name", "trt_io"]
