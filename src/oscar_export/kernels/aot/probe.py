"""Two tiny kernels that exercise the AOT machinery end to end without depending on the serving kernels.

``_pack_codes_kernel`` packs 2-bit codes exactly like ``reference.pack_codes`` (integer only: every
implementation must agree to the bit). ``_dequant_rows_kernel`` reads packed token-granular rows back to
fp32 like ``reference.dequantize_pages`` (float math: a compiler may fuse ``lo + s * c`` into one FMA, so
it is compared to the reference within one rounding, and to the JIT launch of itself bit for bit).
Both ship in every bundle as a self-test a host (the TensorRT-LLM module, the GPU test) can run first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .spec import KernelSpec, Param


@triton.jit
def _pack_codes_kernel(codes_ptr, out_ptr, rows, D: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr):
    """codes ``[rows, D]`` uint8 in 0..3 -> ``[rows, D // 4]`` uint8 (docs/design.md §3.1 bit order)."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]  # [BR, 1]
    j = tl.arange(0, D // 4)[None, :]  # [1, D/4] byte index in the row
    base = (j // (G // 4)) * G + j % (G // 4)  # first element of byte j
    m = r < rows
    acc = tl.zeros([BLOCK_R, D // 4], dtype=tl.uint8)
    for k in tl.static_range(4):
        c = tl.load(codes_ptr + r * D + base + k * (G // 4), mask=m, other=0)
        acc = acc | ((c & 3) << (2 * k))
    tl.store(out_ptr + r * (D // 4) + j, acc, mask=m)


@triton.jit
def _dequant_rows_kernel(packed_ptr, params_ptr, out_ptr, rows, D: tl.constexpr, G: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """packed ``[rows, D // 4]`` uint8 + params ``[rows, D // G, 2]`` fp16 -> ``[rows, D]`` fp32 (uniform levels)."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]  # [BR, 1]
    e = tl.arange(0, D)[None, :]  # [1, D] element index
    g = e // G
    byte = g * (G // 4) + (e % G) % (G // 4)
    shift = ((e % G) // (G // 4)) * 2
    m = r < rows
    code = (tl.load(packed_ptr + r * (D // 4) + byte, mask=m, other=0) >> shift.to(tl.uint8)) & 3
    s = tl.load(params_ptr + (r * (D // G) + g) * 2, mask=m, other=0.0).to(tl.float32)
    lo = tl.load(params_ptr + (r * (D // G) + g) * 2 + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * D + e, lo + s * code.to(tl.float32), mask=m)


_MODULE = "oscar_export.kernels.aot.probe"


def probe_specs(head_dim: int = 64, group_size: int = 64, block_rows: int = 16) -> list[KernelSpec]:
    """The two probe kernels for one ``(D, G)``."""
    common = dict(
        constexprs=(("BLOCK_R", block_rows), ("D", head_dim), ("G", group_size)),
        grid=("cdiv(rows, BLOCK_R)", "1", "1"),
        num_warps=4,
        num_stages=1,
    )
    return [
        KernelSpec(
            name=f"probe_pack_codes_d{head_dim}_g{group_size}",
            kernel=f"{_MODULE}:_pack_codes_kernel",
            params=(Param("codes_ptr", "*u8"), Param("out_ptr", "*u8"), Param("rows", "i32")),
            doc="self-test: pack 2-bit codes (exact vs reference.pack_codes)",
            **common,
        ),
        KernelSpec(
            name=f"probe_dequant_rows_d{head_dim}_g{group_size}",
            kernel=f"{_MODULE}:_dequant_rows_kernel",
            params=(
                Param("packed_ptr", "*u8"), Param("params_ptr", "*fp16"), Param("out_ptr", "*fp32"),
                Param("rows", "i32"),
            ),
            doc="self-test: dequantize token-granular rows (vs reference.dequantize_pages)",
            **common,
        ),
    ]


__all__ = ["probe_specs"]
