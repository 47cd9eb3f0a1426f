"""The hopper kernel's page operands (``kernels/decode/hopper_operands.py``, Gluon): ``assert_trivial`` is a real check.
The operands' arithmetic: test_decode_hopper_emulation.py (``emulate_a_operand``); the kernel's operand conversions
proven trivial across the shapes it claims: test_decode_hopper_kernel.py (compiled for sm_90 on the CPU)."""

from __future__ import annotations

import pytest

from oscar_export.kernels.decode import hopper_operands as gl_attn


def test_a_non_trivial_operand_layout_fails_compilation():
    """``assert_trivial`` is a real check: a load layout that is not the A layout does not compile."""
    pytest.importorskip("triton")
    if not gl_attn.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    @gluon.jit
    def wrong_rows(k_ptr, out_ptr):
        # two rows of 4 halves per thread instead of one lane's 8 halves of one row: not the wgmma A layout
        LW: gl.constexpr = gl.BlockedLayout([2, 4], [16, 2], [4, 1], [1, 0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, LW))
        c = gl.arange(0, 8, layout=gl.SliceLayout(0, LW))
        h = gl.load(k_ptr + r[:, None] * 8 + c[None, :])
        a = gl_attn.a_operand(h, 64, 128, A_L)
        gl.store(out_ptr + gl.arange(0, 1, layout=gl.BlockedLayout([1], [32], [4], [0])), gl.sum(gl.sum(
            gl.convert_layout(a, gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])).to(gl.float32), axis=1), axis=0))

    src = GluonASTSource(wrong_rows, {"k_ptr": "*u16", "out_ptr": "*fp32"}, {}, {})
    with pytest.raises(Exception) as err:  # triton's CompilationError, caused by convert_layout's TypeError
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "is not trivial" in f"{err.value} {err.value.__cause__}", err.value
