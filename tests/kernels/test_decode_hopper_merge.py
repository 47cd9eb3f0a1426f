"""The hopper decode kernel's fused merge (Gluon, ``kernels/decode/hopper_merge.py``) on the CPU: compiled for sm_90
into the split kernel, its ordering in the PTX (Gluon has no interpreter; it runs on the H200:
tests/gpu/test_kernels_gpu.py -k gluon)."""

from __future__ import annotations

import re

import pytest

from oscar_export.kernels.decode import hopper_kernel as gl_attn

from helpers import hopper_split_spec


@pytest.mark.parametrize("gran,d,p,gq", [("token", 128, 128, 4), ("channel", 256, 128, 8), ("token", 64, 64, 1)])
def test_fused_merge_compiles_with_the_grid_barrier_ordering(gran, d, p, gq):
    """The fused kernel counts its programs the cooperative-groups way: the partial stores, a CTA barrier, one
    thread's ``atom.acq_rel.gpu`` add (its result shared through the CTA), then the partials read from L2;
    the plain split kernel has no atomic."""
    pytest.importorskip("triton")
    if not gl_attn.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from oscar_export.kernels.aot.compile import compile_kernel
    from oscar_export.kernels.aot.launch_plan import DECODE_SPLIT_MERGE_GL
    from oscar_export.kernels.aot.spec import KernelSpec

    plain = hopper_split_spec(gran, d, p, gq)
    fused = KernelSpec.from_plan(DECODE_SPLIT_MERGE_GL, plain.name.replace("split", "split_merge"),
                                 dict(plain.constexprs), maxnreg=plain.maxnreg)
    ptx = compile_kernel(fused, "sm_90").ptx.decode()
    atom = re.search(r"@%p\d+ atom\.global\.gpu\.acq_rel\.add\.u32", ptx)
    assert atom, "one predicated acq_rel add at gpu scope"
    assert ptx.count("atom.global") == 1
    before = ptx[:atom.start()]
    assert before.rfind("bar.sync") > before.rfind("st.global"), "a CTA barrier between the partial stores and the add"
    assert "ld.global.cg" in ptx[atom.end():], "the partials are read from L2"
    assert "atom." not in compile_kernel(plain, "sm_90").ptx.decode()
