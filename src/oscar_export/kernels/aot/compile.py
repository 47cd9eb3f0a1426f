"""Ahead-of-time compile ``KernelSpec``s to cubin + PTX per target, on a machine with no GPU (docs/design.md §3.5).

``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cap, 32))`` runs the
whole Triton pipeline and ``ptxas`` without a driver. We do not use ``triton/tools/compile.py`` (its CLI
needs an active driver and mis-parses ``--target``).

Gates every compiled kernel must pass (else ``BundleError``): both hidden scratch sizes are 0 (the
launcher passes NULL for them), the PTX entry has ``len(params) + 2`` parameters, shared memory fits the
target, and no runtime parameter is a float (checked by ``Param``).

Builds are byte-reproducible: line info is off (no source paths in PTX/cubin), the PTX ISA version is
pinned (``ptx_version``, default 8.8 = CUDA 12.9, which the H200's 580 driver JIT-compiles), files and
manifest keys are written in a fixed order, and the manifest holds no timestamps or absolute paths.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .manifest import (
    FORMAT_VERSION,
    HIDDEN_PARAMS,
    SHARED_LIMIT,
    BundleError,
    KernelEntry,
    arch_name,
    manifest_key_bits,
    manifest_packing,
    parse_arch,
    ptx_entry_params,
    write_manifest,
)
from .spec import KernelSpec

DEFAULT_ARCHS = ("sm_80", "sm_89", "sm_90")
#: PTX ISA 8.8 (CUDA 12.9): accepted by ptxas 12.9 (sm_80/89) and 13.x (sm_90) and JIT-able by driver >= 575.
DEFAULT_PTX_VERSION = 88


@dataclass(frozen=True)
class CompiledKernel:
    entry: KernelEntry
    cubin: bytes
    ptx: bytes


def _require_triton():
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        raise ImportError("AOT compilation needs Triton >= 3.3: pip install 'oscar-export[triton]'") from e
    return triton, ASTSource, GPUTarget


@contextlib.contextmanager
def _without_line_info():
    """Compile without line info (no source paths in PTX/cubin) through Triton's knobs, restored afterwards.

    Older Triton without ``knobs.compilation.scope`` compiles with line info (still reproducible on one
    machine, but the PTX then names the source file path).
    """
    try:
        from triton import knobs

        scope = knobs.compilation.scope
    except (ImportError, AttributeError):
        yield
        return
    with scope():
        knobs.compilation.disable_line_info = True
        yield


def ptxas_version(cap: int) -> str:
    """Version string of the ptxas Triton uses for ``cap`` (recorded in the manifest)."""
    try:
        from triton.backends.nvidia import compiler as nv

        try:
            out = nv.get_ptxas_version(cap)
        except TypeError:  # older Triton: no arch argument
            out = nv.get_ptxas_version()
    except Exception:  # a private API: never fail a build over a version string
        return "unknown"
    for line in str(out).splitlines():
        if "release" in line:
            return line.split("release", 1)[1].split(",")[0].strip()
    return str(out).strip().splitlines()[-1] if out else "unknown"


def compile_kernel(spec: KernelSpec, arch: str | int, ptx_version: int | None = DEFAULT_PTX_VERSION) -> CompiledKernel:
    """Compile one spec for one target and check the gates (see the module doc).

    ``ptx_version=None`` lets Triton pick the newest PTX ISA its ptxas accepts.
    """
    triton, ASTSource, GPUTarget = _require_triton()
    cap = parse_arch(arch)
    fn = spec.jit_function()
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (decode/hopper_kernel): its own frontend
        if cap != 90:
            raise BundleError(f"{spec.name} ({arch_name(cap)}): a Gluon kernel of warpgroup MMAs runs on sm_90 "
                              f"(Hopper) only; build this bundle for sm_90")
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(fn=fn, signature=spec.signature(fn), constexprs=spec.constexpr_dict, attrs=spec.attrs(fn))
    options = {
        "num_warps": spec.num_warps, "num_stages": spec.num_stages,
        "enable_fp_fusion": True,  # the JIT default: AOT and JIT launches must agree to the bit
    }
    if spec.maxnreg:
        options["maxnreg"] = spec.maxnreg
    if ptx_version is not None:
        options["ptx_version"] = ptx_version
    with _without_line_info():
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)
    md = k.metadata
    where = f"{spec.name} ({arch_name(cap)})"
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        size = getattr(md, scratch, 0) or 0
        if size != 0:
            raise BundleError(f"{where}: {scratch} = {size}; AOT launches pass NULL scratch, so it must be 0")
    shared = int(md.shared)
    if shared > SHARED_LIMIT[cap]:
        raise BundleError(f"{where}: needs {shared} bytes of shared memory, {arch_name(cap)} allows "
                          f"{SHARED_LIMIT[cap]}")
    ptx = k.asm["ptx"]
    n = ptx_entry_params(ptx, md.name)
    if n != len(spec.params) + HIDDEN_PARAMS:
        raise BundleError(f"{where}: PTX entry has {n} parameters, expected {len(spec.params)} + {HIDDEN_PARAMS} "
                          "hidden")
    entry = KernelEntry(
        spec=spec, arch=cap, symbol=md.name, shared=shared,
        cubin_file=f"{spec.name}.{arch_name(cap)}.cubin", cubin_sha256="",
        ptx_file=f"{spec.name}.{arch_name(cap)}.ptx", ptx_sha256="",
    )
    return CompiledKernel(entry=entry, cubin=bytes(k.asm["cubin"]), ptx=ptx.encode())


def build_bundle(
    specs: Sequence[KernelSpec],
    out_dir: str | Path,
    archs: Iterable[str] = DEFAULT_ARCHS,
    ptx_version: int | None = DEFAULT_PTX_VERSION,
    progress=None,
    packing: dict[str, str] | None = None,
    key_bits: Sequence[int] | None = None,
) -> Path:
    """Compile every spec for every arch into ``out_dir`` (written atomically: temp dir, then rename).

    ``out_dir`` must not exist. ``progress``, if given, is called with ``(done, total, name)``. ``packing``:
    the code packing of the K and V pages the kernels read and write (``{"key": .., "value": ..}``, layout
    ``RowFormat.packing``), recorded in the manifest; default both ``"linear"``. ``key_bits``: the key code
    widths the specs have variants for (``bundle.serving_specs(..., key_bits=)``), recorded; default ``[2]``.
    """
    triton, _, _ = _require_triton()
    bits = manifest_key_bits(None if key_bits is None else list(key_bits))
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new output directory")
    caps = sorted({parse_arch(a) for a in archs})
    if not caps:
        raise ValueError("build_bundle: expected at least one arch")
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"build_bundle: expected unique, non-empty kernel names, got {names}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        kernels = []
        total, done = len(specs) * len(caps), 0
        for spec in sorted(specs, key=lambda s: s.name):
            for cap in caps:
                ck = compile_kernel(spec, cap, ptx_version)
                (tmp / ck.entry.cubin_file).write_bytes(ck.cubin)
                (tmp / ck.entry.ptx_file).write_bytes(ck.ptx)
                kernels.append(ck.entry.to_dict(ck.cubin, ck.ptx))
                done += 1
                if progress is not None:
                    progress(done, total, f"{spec.name}.{arch_name(cap)}")
        write_manifest(tmp, {
            "format": FORMAT_VERSION,
            "triton_version": triton.__version__,
            "ptxas": {arch_name(c): ptxas_version(c) for c in caps},
            "ptx_version": ptx_version,
            "hidden_params": "two trailing NULL pointers (global, profile scratch); both sizes are 0",
            "kernels": kernels,
            "packing": manifest_packing(packing),
            "key_bits": bits,
        })
        os.chmod(tmp, 0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = ["DEFAULT_ARCHS", "DEFAULT_PTX_VERSION", "CompiledKernel", "build_bundle", "compile_kernel", "ptxas_version"]
