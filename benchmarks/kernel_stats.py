"""Static cost of a Triton kernel variant on sm_90, from its SASS, without a GPU.

    PYTHONPATH=/tmp/t36 python3 benchmarks/kernel_stats.py decode [--set NB=4 --set K_CHANNEL=true] [--warps 4] [--sass out.sass]
    PYTHONPATH=/tmp/t36 python3 benchmarks/kernel_stats.py quant  [--set CHANNEL=true] [--warps 8]
    PYTHONPATH=/tmp/t36 python3 benchmarks/kernel_stats.py decode --set PACKING=mma16 [--set P=64]   (the v2 kernel)

Compiles through ``kernels/aot`` (the bundle's compiler: ``triton.compile`` + ptxas, no driver), then reads
the cubin with the ``cuobjdump``/``nvdisasm`` that ship with Triton. Prints registers, spill bytes, shared
memory, and the instruction mix of the hottest loop (the longest backward-branch body that contains an MMA
or, failing that, the longest loop), per warp per iteration: total, MMA, shared loads/stores, barriers,
global loads, shuffles, conversions. Use the Triton the GPU runs (``PYTHONPATH=/tmp/t36`` for 3.6 here):
the counts are what the H200 would issue, before stalls. It predicts issue cost, not time; the GPU
benchmark (``bench_decode.py``) is what decides.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path


import triton  # noqa: E402

from oscar_export.kernels.aot.bundle import decode_split_spec, quant_pack_spec, layout_tag  # noqa: E402
from oscar_export.kernels.aot.compile import compile_kernel  # noqa: E402
from oscar_export.kernels.aot.launch_plan import DECODE_SPLIT_GL, gl_occupancy  # noqa: E402
from oscar_export.kernels.aot.spec import KernelSpec, Param  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout  # noqa: E402

INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CLASSES = {
    "mma": ("HMMA", "IMMA", "HGMMA", "IGMMA"),
    "lds": ("LDS", "LDSM"),
    "sts": ("STS",),
    "bar": ("BAR",),
    "ldg": ("LDG", "LDGSTS"),
    "stg": ("STG",),
    "shfl": ("SHFL",),
    "prmt": ("PRMT",),
    "cvt": ("F2F", "I2F", "F2I", "F2FP", "I2FP"),
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "MUFU", "FSEL", "FSETP"),
}


def _parse_value(v: str):
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    try:
        return int(v)
    except ValueError:
        return float(v)


def build_spec(which: str, sets: dict, warps: int | None, stages: int | None) -> KernelSpec:
    kernel = sets.pop("KERNEL", None)
    channel = bool(sets.pop("K_CHANNEL" if which == "decode" else "CHANNEL", False))
    gran = "channel" if channel else "token"
    layout = KVCacheLayout.default(sets.pop("H_KV", 8), sets.pop("D", 128), key_granularity=gran,
                                   packing=sets.pop("PACKING", "linear"), page_size=sets.pop("P", None))
    if which == "decode":
        spec = decode_split_spec(layout, 4 * layout.num_kv_heads, layout.head_dim ** -0.5, layout_tag(layout, 32))
    else:
        spec = quant_pack_spec(layout, layout.key, "k", bool(sets.pop("ROTATE", False)), layout_tag(layout, 32))
    cx = spec.constexpr_dict
    if which == "decode":
        cx["ROTATE_Q"] = False  # as bench_decode.py runs it
    cx.update(sets)
    params = spec.params
    if kernel:  # another kernel with the same argument names: its runtime arguments, typed like the spec's
        module, attr = kernel.split(":")
        fn = getattr(importlib.import_module(module), attr)
        types = {p.name: p.type for p in spec.params}
        params = tuple(Param(a, types[a]) for a in fn.arg_names if a not in cx)
    return KernelSpec(name=spec.name, kernel=kernel or spec.kernel, params=params,
                      constexprs=tuple(sorted(cx.items())), grid=spec.grid, grid_inputs=spec.grid_inputs,
                      num_warps=warps or spec.num_warps, num_stages=stages or spec.num_stages,
                      maxnreg=gl_occupancy(layout.head_dim)[0] if (kernel or spec.kernel) == DECODE_SPLIT_GL.kernel
                      else spec.maxnreg)


def sass_of(cubin: bytes) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    return res, sass


def hottest_loop(sass: str) -> list[str]:
    """Instructions of the longest loop body (label .. backward branch) that holds an MMA, else the longest."""
    lines = [ln for ln in sass.splitlines() if ln.strip()]
    labels, loops = {}, []
    for i, ln in enumerate(lines):
        m = re.match(r"^\s*(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    bodies = [[ln for ln in lines[a:b + 1] if INSTR.search(ln)] for a, b in loops]
    with_mma = [b for b in bodies if any("MMA" in ln for ln in b)]
    pool = with_mma or bodies
    return max(pool, key=len) if pool else []


def mix(instrs: list[str]) -> Counter:
    c = Counter(total=len(instrs))
    for ln in instrs:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if not m:
            continue
        op = m.group(1)
        for cls, prefixes in CLASSES.items():
            if op.startswith(prefixes):
                c[cls] += 1
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=("decode", "quant"))
    ap.add_argument("--set", action="append", default=[], help="constexpr override NAME=VALUE (KERNEL=module:attr)")
    ap.add_argument("--warps", type=int)
    ap.add_argument("--stages", type=int)
    ap.add_argument("--sass", help="write the full SASS here")
    args = ap.parse_args()
    sets = {}
    for s in args.set:
        k, v = s.split("=", 1)
        sets[k] = v if k in ("KERNEL", "PACKING") else _parse_value(v)
    spec = build_spec(args.which, sets, args.warps, args.stages)
    ck = compile_kernel(spec, "sm_90", ptx_version=None)
    res, sass = sass_of(ck.cubin)
    if args.sass:
        Path(args.sass).write_text(sass)
    n_sass = sum(1 for ln in sass.splitlines() if INSTR.search(ln))
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    loop = hottest_loop(sass)
    c = mix(loop)
    print(f"triton {triton.__version__} sm_90 {spec.kernel.split(':')[1]} warps={spec.num_warps} "
          f"stages={spec.num_stages} {dict(sorted(sets.items()))}")
    print(f"  regs {regs.group(1) if regs else '?'}  stack {stack.group(1) if stack else '?'} B  "
          f"shared {ck.entry.shared} B  SASS {n_sass}")
    print("  hottest loop per warp-iteration: " + "  ".join(f"{k} {c[k]}" for k in ["total", *CLASSES] if c[k]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
