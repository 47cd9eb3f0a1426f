"""A kernel bundle over stand-in binaries, for tests of code that reads a bundle but never launches it.

The manifest is the real one for the given specs (parameters, constexprs, warps, grid from the launch plan);
each PTX file only declares the kernel's entry with the right parameter count and each cubin only names the
symbol, which is all ``read_manifest`` checks. Registration code reads the PTX as text; nothing runs it.
Real binaries: tests/kernels/test_aot_bundle.py (compile) and tests/gpu/ (launch).
"""

from __future__ import annotations

from pathlib import Path

from oscar_export.kernels.aot.manifest import FORMAT_VERSION, HIDDEN_PARAMS, KernelEntry, write_manifest


def fake_bundle(root: Path, specs, archs=("sm_80", "sm_90"), shared: int = 1024) -> Path:
    root.mkdir(parents=True)
    kernels = []
    for spec in specs:
        for arch in archs:
            cap = int(arch.split("_")[1])
            sym = f"{spec.name}_0d1d"
            params = ", ".join(f".param .u64 p{i}" for i in range(len(spec.params) + HIDDEN_PARAMS))
            ptx, cubin = f".visible .entry {sym}({params})\n{{ ret; }}\n".encode(), b"\x7fELF" + sym.encode() + b"\0"
            entry = KernelEntry(spec, cap, sym, shared, f"{spec.name}.{arch}.cubin", "", f"{spec.name}.{arch}.ptx", "")
            (root / entry.cubin_file).write_bytes(cubin)
            (root / entry.ptx_file).write_bytes(ptx)
            kernels.append(entry.to_dict(cubin, ptx))
    write_manifest(root, {"format": FORMAT_VERSION, "triton_version": "stand-in", "kernels": kernels})
    return root
