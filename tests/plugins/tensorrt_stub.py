"""TensorRT's pure-Python plugin layer (``tensorrt.plugin``) with only its native module replaced.

The ``tensorrt-cu13-bindings`` wheel (install.sh installs it) ships the real ``tensorrt/plugin/*.py`` sources
(as ``tensorrt_bindings/plugin``) next to a native ``tensorrt.so`` that cannot load here (no TensorRT libraries).
:func:`load_tensorrt_plugin` builds a stand-in for the native module -- enums, plain containers, a plugin
registry and an expression builder that computes on integers -- and executes upstream's own plugin sources on
top of it, so their validators (``_parse_register_inputs``, ``_validate_aot_impl``, ``create_plugin``'s
attribute check, ``get_output_shapes``, ``get_launch_params``) run unchanged on our ``register_plugins()``.

Everything below stands in for C++ objects only; no upstream Python logic is re-implemented.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from pathlib import Path


def plugin_sources() -> Path | None:
    """The wheel's ``plugin/`` directory, or None when the wheel is not installed."""
    for name in ("tensorrt_bindings", "tensorrt"):
        spec = importlib.util.find_spec(name) if name not in sys.modules else None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            if (Path(loc) / "plugin" / "_validate.py").is_file():
                return Path(loc) / "plugin"
    return None


class FakeExpr:
    """A ``trt.IDimensionExpr`` holding a known integer (what TensorRT would resolve at runtime)."""

    def __init__(self, value: int) -> None:
        self.value = int(value)

    def is_constant(self) -> bool:
        return True

    def get_constant_value(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"FakeExpr({self.value})"


class FakeExprBuilder:
    """``trt.IExprBuilder``: ``constant`` and ``operation`` on integers; counts operations."""

    def __init__(self) -> None:
        self.ops = 0

    def constant(self, value: int) -> FakeExpr:
        return FakeExpr(value)

    def operation(self, op, a: FakeExpr, b: FakeExpr) -> FakeExpr:
        self.ops += 1
        x, y = a.value, b.value
        D = sys.modules["tensorrt"].DimensionOperation
        return FakeExpr({D.SUM: lambda: x + y, D.PROD: lambda: x * y, D.SUB: lambda: x - y,
                         D.FLOOR_DIV: lambda: x // y, D.CEIL_DIV: lambda: -(-x // y), D.MAX: lambda: max(x, y),
                         D.MIN: lambda: min(x, y), D.EQUAL: lambda: int(x == y), D.LESS: lambda: int(x < y)}[op]())


class LaunchParamsOut:
    """The native ``KernelLaunchParams`` TensorRT passes in: upstream assigns ``SymExprImpl`` objects to it."""

    grid_x = grid_y = grid_z = block_x = block_y = block_z = shared_mem = None


class SymExprSetter:
    """The native extra-argument setter: ``nbSymExprs`` then ``[i] = SymExprImpl``."""

    def __init__(self) -> None:
        self.nbSymExprs = 0
        self.items: dict[int, object] = {}

    def __setitem__(self, i: int, v: object) -> None:
        if i >= self.nbSymExprs:
            raise IndexError(i)
        self.items[i] = v


def _native_module() -> types.ModuleType:
    trt = types.ModuleType("tensorrt")

    class _Base:
        def __init__(self, *args, **kwargs) -> None:
            pass

    for name in ("IPluginV3", "IPluginV3QuickCore", "IPluginV3QuickBuild", "IPluginV3QuickRuntime",
                 "IPluginV3QuickAOTBuild", "IPluginCreatorV3Quick", "ISymExpr", "ITensor", "IExprBuilder"):
        setattr(trt, name, type(name, (_Base,), {}))
    trt.IDimensionExpr = FakeExpr
    trt.DimensionOperation = enum.Enum("DimensionOperation", "SUM PROD MAX MIN SUB EQUAL LESS FLOOR_DIV CEIL_DIV")
    trt.DataType = enum.Enum("DataType", "FLOAT HALF BF16 INT8 INT32 INT64 UINT8 BOOL FP8 INT4")
    for alias, member in (("float32", "FLOAT"), ("float16", "HALF"), ("bfloat16", "BF16"), ("int8", "INT8"),
                          ("int32", "INT32"), ("int64", "INT64"), ("uint8", "UINT8"), ("bool", "BOOL")):
        setattr(trt, alias, trt.DataType[member])
    trt.PluginFieldType = enum.Enum("PluginFieldType",
                                    "FLOAT16 FLOAT32 FLOAT64 INT8 INT16 INT32 INT64 CHAR DIMS UNKNOWN BF16")
    trt.TensorFormat = enum.Enum("TensorFormat", "LINEAR CHW2 HWC8")
    trt.QuickPluginCreationRequest = enum.Enum("QuickPluginCreationRequest",
                                               "UNKNOWN PREFER_JIT PREFER_AOT STRICT_JIT STRICT_AOT")
    trt.TensorRTPhase = enum.Enum("TensorRTPhase", "BUILD RUNTIME")
    trt.PluginArgType = enum.Enum("PluginArgType", "INT")
    trt.PluginArgDataType = enum.Enum("PluginArgDataType", "INT8 INT16 INT32")

    class Logger:
        WARNING, INFO, ERROR = 1, 2, 3

        def log(self, severity, msg) -> None:
            pass

    class PluginField:
        def __init__(self, name, data=None, type=None) -> None:
            self.name, self.data, self.type = name, data, type

    class PluginFieldCollection(list):
        pass

    class Dims(list):
        MAX_DIMS = 8

        def __init__(self, shape=()) -> None:
            super().__init__([0] * shape if isinstance(shape, int) else list(shape))

    class DimsExprs(list):
        def __init__(self, n: int) -> None:
            super().__init__([None] * n)

    class PluginTensorDesc:
        def __init__(self, dims=(), type=None, format=None, scale=1.0) -> None:
            self.dims, self.type, self.format, self.scale = Dims(dims), type, format, scale

    class DynamicPluginTensorDesc:
        def __init__(self, desc=None) -> None:
            self.desc = desc or PluginTensorDesc()
            self.min = self.max = self.opt = tuple(self.desc.dims)

    class Registry:
        def __init__(self) -> None:
            self.creators: dict[tuple[str, str], object] = {}

        def register_creator(self, creator, namespace) -> None:
            self.creators[(namespace, creator.name)] = creator

        def get_creator(self, name, version, namespace):
            return self.creators.get((namespace, name))

    registry = Registry()
    for obj in (Logger, PluginField, PluginFieldCollection, Dims, DimsExprs, PluginTensorDesc,
                DynamicPluginTensorDesc):
        setattr(trt, obj.__name__, obj)
    trt.get_plugin_registry = lambda: registry
    trt.nptype = lambda dtype: None
    return trt


def load_tensorrt_plugin(monkeypatch, sources: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """``(trt, trtp)``: the native stand-in and upstream's ``tensorrt.plugin`` executed on it, installed in
    ``sys.modules`` for the test (``monkeypatch`` restores it)."""
    for name in [m for m in sys.modules if m == "tensorrt" or m.startswith("tensorrt.")]:
        monkeypatch.delitem(sys.modules, name)
    trt = _native_module()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    spec = importlib.util.spec_from_file_location("tensorrt.plugin", sources / "__init__.py",
                                                  submodule_search_locations=[str(sources)])
    trtp = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    trt.plugin = trtp
    spec.loader.exec_module(trtp)
    for name in [m for m in sys.modules if m.startswith("tensorrt.plugin.")]:
        monkeypatch.setitem(sys.modules, name, sys.modules[name])  # removed again after the test
    return trt, trtp
