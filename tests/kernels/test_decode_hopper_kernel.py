"""The hopper decode kernel (Gluon, ``kernels/decode/hopper_kernel.py``) on the CPU: what can be checked here.

Gluon has no interpreter, so the kernel itself runs only on a GPU (tests/gpu/test_kernels_gpu.py -k gluon). Here:

* its compilation for sm_90 by this Triton (the AOT builder's), across the shapes it claims: every
  ``convert_layout(..., assert_trivial=True)`` of a page operand is proven a no-op by the compiler, and the
  loop holds no spills;
* its arithmetic, in PyTorch: test_decode_hopper_emulation.py (``kernels/decode/hopper_emulation.py``);
* which layouts select it: test_decode_backend.py (its refusals: test_checks.py); its wrapper
  (``kernels/decode/hopper.py``): test_decode_hopper.py.
"""

from __future__ import annotations

import re

import pytest

from oscar_export.kernels.decode import hopper_kernel as gl_attn
from oscar_export.kernels.layout import KVCacheLayout

from helpers import hopper_split_spec

# ---- compilation for sm_90 (no GPU needed: triton.compile + ptxas) -------------------------------------------------

SHAPES = [  # (granularity, head_dim, page_size, query heads per KV head, key bits)
    ("token", 128, 128, 4, 2), ("channel", 128, 128, 4, 2), ("token", 128, 64, 4, 2), ("token", 64, 64, 3, 2),
    ("channel", 256, 128, 8, 2), ("token", 256, 64, 16, 2), ("channel", 64, 128, 1, 2), ("token", 128, 128, 4, 4),
    ("channel", 128, 128, 4, 4), ("channel", 64, 64, 3, 4), ("token", 256, 128, 8, 4),
]
#: head_dim 256 with the default two token groups of 128 a row (``NG`` 2): (granularity, page size, GQ, key bits)
TWO_GROUP_SHAPES = [("token", 128, 2, 2), ("token", 64, 8, 4), ("channel", 128, 2, 2)]


@pytest.mark.parametrize("gran,d,p,gq,key_bits", SHAPES)
def test_compiles_for_sm90_with_trivial_operand_layouts(gran, d, p, gq, key_bits):
    pytest.importorskip("triton")
    if not gl_attn.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from oscar_export.kernels.aot.compile import compile_kernel

    spec = hopper_split_spec(gran, d, p, gq, key_bits=key_bits)
    ck = compile_kernel(spec, "sm_90")  # raises if an operand conversion is not trivial
    ptx = ck.ptx.decode()
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.f16\.f16 ", ptx), "the dots are warpgroup MMAs"
    assert re.search(r"cp\.async\.c[ga]\.shared\.global", ptx), "the pages stream through cp.async"
    assert (f".maxnreg {spec.maxnreg}" in ptx) == bool(spec.maxnreg), "the cap reaches the PTX (the driver's JIT)"
    usage = _res_usage(ck.cubin)
    if usage is not None:
        if spec.maxnreg:  # the cap holds; it may cost a few spills (the plan trades them for a 4th CTA an SM)
            assert usage["REG"] <= spec.maxnreg, usage
        else:
            assert usage["STACK"] == 0, f"the kernel spills ({usage['STACK']} B of stack)"


@pytest.mark.parametrize("gran,p,gq,key_bits", TWO_GROUP_SHAPES)
def test_two_groups_a_row_compile_for_sm90_without_spills(gran, p, gq, key_bits):
    pytest.importorskip("triton")
    if not gl_attn.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from oscar_export.kernels.aot.compile import compile_kernel
    from oscar_export.kernels.aot.launch_plan import DECODE_SPLIT_GL, decode_split_gl_constexprs, gl_occupancy
    from oscar_export.kernels.aot.spec import KernelSpec

    lay = KVCacheLayout.default(8, 256, gran, packing="mma16", page_size=p).with_key_bits(key_bits)
    cx = decode_split_gl_constexprs(lay, 8 * gq, 256**-0.5)
    assert cx["NG"] == 2
    spec = KernelSpec.from_plan(DECODE_SPLIT_GL, f"decode_split_gl_ng2_{gran}_p{p}_g{gq}_k{key_bits}", cx,
                                maxnreg=gl_occupancy(256)[0])
    ck = compile_kernel(spec, "sm_90")
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.f16\.f16 ", ck.ptx.decode())
    usage = _res_usage(ck.cubin)
    if usage is not None:
        assert usage["STACK"] == 0, f"the kernel spills ({usage['STACK']} B of stack)"


def _res_usage(cubin: bytes) -> dict | None:
    """``{"REG": registers, "STACK": bytes}`` per thread of a cubin (``cuobjdump -res-usage``, shipped with
    Triton), None without the tool."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"REG": int(m.group(1)), "STACK": int(m.group(2))} if m else None
