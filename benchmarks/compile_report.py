"""What the serving kernels cost in registers, spills, shared memory and instructions on sm_90, without a GPU.

    python benchmarks/compile_report.py [--heads llama3-8b,gemma3-12b] [--json out.json]

Run it with the Triton of the GPU image (3.6.0: a separate virtualenv on the CPU machine) before any device call:
a kernel that does not compile there, spills, or grows its instruction count is found here at no GPU time. Every
kernel the README loop and the AOT bundle launch for the default layout (channel keys, the page packing an sm_90
target serves, 2- and 4-bit keys) is compiled as the bundle compiles it (``kernels/aot/compile.py``; the PTX ISA
Triton's own ptxas takes, 8.7 under Triton 3.6), then its PTX is assembled again by the system's ``ptxas -v`` for
the resource counts. Per kernel: registers a thread, spill stores / loads
(bytes), stack frame (bytes), shared memory (bytes, Triton's), PTX instructions (lines of the kernel body that
end in ``;``, directives excluded).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

from oscar_export.bench import HEADS
from oscar_export.kernels.aot.bundle import serving_layout, serving_specs
from oscar_export.kernels.aot.compile import compile_kernel
from oscar_export.kernels.layout import KVCacheLayout

_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_usage(ptx: bytes) -> dict:
    """``ptxas -arch=sm_90 -v`` of one kernel's PTX: registers, stack frame, spill stores and loads."""
    with tempfile.TemporaryDirectory() as td:
        src = Path(td) / "k.ptx"
        src.write_bytes(ptx)
        target = re.search(rb"\.target (sm_\w+)", ptx).group(1).decode()  # sm_90a where wgmma is used
        proc = subprocess.run(["ptxas", f"-arch={target}", "-v", str(src), "-o", str(Path(td) / "k.cubin")],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas: {proc.stderr.strip()[-300:]}")
    used, spill = _USED.search(proc.stderr), _SPILL.search(proc.stderr)
    return {"registers": int(used.group(1)), "stack": int(spill.group(1)), "spill_stores": int(spill.group(2)),
            "spill_loads": int(spill.group(3))}


def ptx_instructions(ptx: bytes) -> int:
    body = ptx.decode().split(".entry", 1)[-1]
    return sum(1 for line in body.splitlines()
               if line.strip().endswith(";") and not line.strip().startswith((".", "//", "{", "}")))


def report(heads: str) -> list[dict]:
    hq, hkv, d = HEADS[heads]
    lay = serving_layout(KVCacheLayout.default(hkv, d, "channel"), ["sm_90"], hq, key_bits=(2, 4))
    rows = []
    for spec in serving_specs(lay, hq, d**-0.5, probes=False, trt=False, key_bits=(2, 4)):
        k = compile_kernel(spec, "sm_90", ptx_version=None)  # the newest PTX ISA this Triton's ptxas takes
        rows.append({"heads": heads, "kernel": spec.name, "warps": spec.num_warps, "stages": spec.num_stages,
                     "shared": k.entry.shared, **ptxas_usage(k.ptx), "ptx_instructions": ptx_instructions(k.ptx)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="llama3-8b,gemma3-12b", help=f"comma list of {sorted(HEADS)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90")
    rows = [r for h in args.heads.split(",") for r in report(h)]
    print("\n| heads | kernel | warps / stages | registers | spill st / ld | stack | shared | PTX instr |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['heads']} | {r['kernel']} | {r['warps']} / {r['stages']} | {r['registers']} | "
              f"{r['spill_stores']} / {r['spill_loads']} | {r['stack']} | {r['shared']} | {r['ptx_instructions']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
