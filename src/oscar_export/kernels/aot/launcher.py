"""Load bundle binaries with the CUDA driver API and launch them the way a TensorRT(-LLM) plugin does.

``cuModuleLoadData`` (cubin, or NUL-terminated PTX that the driver JIT-compiles), ``cuModuleGetFunction``,
a parameter check with ``cuFuncGetParamInfo`` against the manifest (count = user params + 2 hidden
scratch pointers, and every size), then ``cuLaunchKernel`` on the caller's stream with two trailing NULLs,
``32 * num_warps`` threads and the manifest's shared memory (parameter order, warps and grid rule: the launch
plan, ``launch_plan.py``, recorded in the manifest's spec).

Argument packing (:func:`pack_arguments`) is plain Python/ctypes and is tested on the CPU: pointers may be
CUDA tensors (dtype, contiguity, alignment and device checked) or raw ``int`` device addresses (what a
host runtime hands a plugin); ``i32`` scalars are range-checked. Needs ``cuda-python``
(``pip install 'oscar-export[gpu]'``) only for loading and launching.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .manifest import HIDDEN_PARAMS, BundleError, KernelEntry, Manifest, arch_name
from .spec import POINTER_ALIGN, Param

#: Triton pointer type -> torch dtype name.
TORCH_DTYPES = {
    "*fp32": "float32", "*fp16": "float16", "*bf16": "bfloat16", "*u8": "uint8", "*i8": "int8",
    "*i32": "int32", "*i64": "int64",
}
_STATIC_SHARED_LIMIT = 49152


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError("launching AOT kernels needs cuda-python: pip install 'oscar-export[gpu]'") from e
    return driver


def _check(result: Any, what: str):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple; raise ``RuntimeError`` naming the call on failure."""
    driver = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err!r} ({msg.decode() if msg else '?'})")
    return rest[0] if len(rest) == 1 else tuple(rest)


@dataclass
class PackedArgs:
    """ctypes storage for one launch; ``pointer`` is the ``void**`` address ``cuLaunchKernel`` reads."""

    values: list[Any]
    array: Any

    @property
    def pointer(self) -> int:
        return ctypes.addressof(self.array)


def _pointer_value(p: Param, value: Any, owner: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{owner}: {p.name} expected a CUDA tensor or device address ({p.type}), got bool")
    if isinstance(value, int):
        addr = value
    elif hasattr(value, "data_ptr"):
        if not getattr(value, "is_cuda", False):
            raise ValueError(f"{owner}: {p.name} expected a CUDA tensor, got one on {value.device}")
        want = TORCH_DTYPES[p.type]
        got = str(value.dtype).removeprefix("torch.")
        if got != want:
            raise TypeError(f"{owner}: {p.name} expected dtype {want}, got {got}")
        if not value.is_contiguous():
            raise ValueError(f"{owner}: {p.name} must be contiguous (strides {tuple(value.stride())})")
        addr = value.data_ptr()
    else:
        raise TypeError(f"{owner}: {p.name} expected a CUDA tensor or device address ({p.type}), got "
                        f"{type(value).__name__}")
    if addr % POINTER_ALIGN:
        raise ValueError(f"{owner}: {p.name} address {addr:#x} is not {POINTER_ALIGN}-byte aligned (compiled "
                         "assumption)")
    return addr


def pack_arguments(entry: KernelEntry, args: Sequence[Any] | Mapping[str, Any]) -> PackedArgs:
    """Check ``args`` (positional in kernel order, or by name) and pack them with the hidden NULLs appended."""
    params = entry.spec.params
    owner = entry.name
    if isinstance(args, Mapping):
        missing = [p.name for p in params if p.name not in args]
        extra = sorted(set(args) - {p.name for p in params})
        if missing or extra:
            raise TypeError(f"{owner}: missing arguments {missing}, unexpected {extra}")
        args = [args[p.name] for p in params]
    if len(args) != len(params):
        raise TypeError(f"{owner}: expected {len(params)} arguments {[p.name for p in params]}, got {len(args)}")
    values: list[Any] = []
    for p, a in zip(params, args):
        if p.is_pointer:
            values.append(ctypes.c_void_p(_pointer_value(p, a, owner)))
        else:
            if isinstance(a, bool) or not isinstance(a, int):
                raise TypeError(f"{owner}: {p.name} expected an int ({p.type}), got {type(a).__name__}")
            if not -(2**31) <= a < 2**31:
                raise ValueError(f"{owner}: {p.name} = {a} does not fit in int32")
            values.append(ctypes.c_int32(a))
    values += [ctypes.c_void_p(0) for _ in range(HIDDEN_PARAMS)]  # global and profile scratch: NULL
    array = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    return PackedArgs(values, array)


def scalar_values(entry: KernelEntry, args: Sequence[Any] | Mapping[str, Any]) -> dict[str, int]:
    """The integer arguments by name (what the grid rule reads)."""
    if isinstance(args, Mapping):
        return {p.name: int(args[p.name]) for p in entry.spec.params if not p.is_pointer}
    return {p.name: int(a) for p, a in zip(entry.spec.params, args) if not p.is_pointer}


class AotKernel:
    """One bundle kernel loaded into the current CUDA context.

    Args:
        manifest: a verified :class:`Manifest` (``read_manifest``).
        name: the variant name.
        arch: target to load (default: the current device's, e.g. ``"sm_90"``).
        source: ``"cubin"`` or ``"ptx"`` (driver JIT).
    """

    def __init__(self, manifest: Manifest, name: str, arch: str | None = None, source: str = "cubin") -> None:
        import torch

        if source not in ("cubin", "ptx"):
            raise ValueError(f"source: expected 'cubin' or 'ptx', got {source!r}")
        driver = _driver()
        if not torch.cuda.is_available():
            raise RuntimeError("AotKernel needs a CUDA device")
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # make the primary context current in this thread
        if arch is None:
            major, minor = torch.cuda.get_device_capability()
            arch = arch_name(10 * major + minor)
        self.entry = manifest.entry(name, arch)
        self.source = source
        image = manifest.binary(self.entry, source)
        if source == "ptx":
            image = image + b"\0"
        self._image = image  # keep alive while the module is loaded
        self.module = _check(driver.cuModuleLoadData(image), f"cuModuleLoadData({self.entry.name}, {source})")
        self.function = _check(
            driver.cuModuleGetFunction(self.module, self.entry.symbol.encode()),
            f"cuModuleGetFunction({self.entry.symbol})"
        )
        self.check_params()
        if self.entry.shared > _STATIC_SHARED_LIMIT:
            _check(
                driver.cuFuncSetAttribute(
                    self.function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    self.entry.shared,
                ),
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
            )

    def param_info(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every parameter the loaded function declares (``cuFuncGetParamInfo``)."""
        driver = _driver()
        info = []
        for i in range(64):
            res = driver.cuFuncGetParamInfo(self.function, i)
            if res[0] != driver.CUresult.CUDA_SUCCESS:
                break
            info.append((int(res[1]), int(res[2])))
        return info

    def check_params(self) -> None:
        """Raise ``BundleError`` unless the binary's parameter list is the manifest's (count and sizes)."""
        got = [size for _, size in self.param_info()]
        want = self.entry.param_bytes()
        if got != want:
            raise BundleError(
                f"{self.entry.name} ({self.source}): binary parameter sizes {got} do not match the manifest {want} "
                f"({len(self.entry.spec.params)} params + {HIDDEN_PARAMS} hidden)"
            )

    def grid(self, args: Sequence[Any] | Mapping[str, Any],
             grid_inputs: Mapping[str, int] | None = None) -> tuple[int, int, int]:
        return self.entry.spec.grid_for({**scalar_values(self.entry, args), **(grid_inputs or {})})

    def launch(
        self, *args: Any, named: Mapping[str, Any] | None = None, grid: tuple[int, int, int] | None = None,
        grid_inputs: Mapping[str, int] | None = None, stream: int | None = None,
    ) -> None:
        """Launch on ``stream`` (default: torch's current stream) with the manifest's grid rule.

        Arguments positionally in kernel order, or ``named`` by parameter name (the order is then the
        manifest's, i.e. the launch plan's). ``grid_inputs`` supplies the spec's launch sizes that are not
        kernel arguments (e.g. ``{"B": 4}``).
        """
        import torch

        if named is not None:
            if args:
                raise TypeError(f"{self.entry.name}: pass arguments positionally or by name, not both")
            args = named  # type: ignore[assignment]

        packed = pack_arguments(self.entry, args)
        gx, gy, gz = grid if grid is not None else self.grid(args, grid_inputs)
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        driver = _driver()
        _check(
            driver.cuLaunchKernel(
                self.function, gx, gy, gz, 32 * self.entry.spec.num_warps, 1, 1, self.entry.shared,
                driver.CUstream(stream), packed.pointer, 0,
            ),
            f"cuLaunchKernel({self.entry.name})",
        )

    def __del__(self) -> None:
        module = getattr(self, "module", None)
        if module is not None:
            try:
                _driver().cuModuleUnload(module)
            except Exception:  # interpreter shutdown: the context may already be gone
                pass


__all__ = ["TORCH_DTYPES", "AotKernel", "PackedArgs", "pack_arguments", "scalar_values"]
