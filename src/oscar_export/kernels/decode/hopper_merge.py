"""The hopper decode kernel's fused merge, in Gluon: the last split program of a (sequence, KV head) merges its splits.

:func:`merge_if_last` ends ``hopper_kernel.py``'s ``_decode_split_merge_gl_kernel`` (the launch plan's
DECODE_SPLIT_MERGE_GL, one launch a decode attention; the JIT default, ``GL_FUSED_MERGE``): a counter a (sequence, KV
head) tells its last program to merge the partials, in the arithmetic of ``splits.py``'s ``merge_kernel`` (the
unfused merge). Gluon has no interpreter: it is compiled for sm_90 on the CPU with the kernel
(tests/kernels/test_decode_hopper_kernel.py) and run on the H200 (tests/gpu/test_kernels_gpu.py).
"""

from __future__ import annotations

from .gluon_names import HAVE_GLUON, cta_barrier, gl, gluon

if HAVE_GLUON:

    @gluon.jit
    def merge_if_last(part_o_ptr, part_lse_ptr, out_ptr, counters_ptr, n_splits, H_KV: gl.constexpr,
                       GQ: gl.constexpr, D: gl.constexpr):
        """The last of the ``n_splits`` programs of a (sequence, KV head) to finish merges their partials into
        ``out [B, H, D]`` and sets the pair's counter back to zero for the next launch.

        Ordering is the cooperative-groups grid barrier's: every thread's partial stores, a CTA barrier, then one
        ``atom.acq_rel.gpu`` add (release: the stores are visible before the count; acquire: the last program
        sees every other program's stores), whose result reaches all threads through the CTA; partials are read
        from L2 (``.cg``). The merge is online over chunks of ``MCH`` splits (all query heads of the KV head at
        once, 64 fp32 registers of partials a thread): the running log2-sum-exp max per head, the weights
        ``2^(lse - max)``, a head with nothing attended gives zeros (as ``merge_kernel``, whose arithmetic this is
        up to the summation order)."""
        bh = gl.program_id(0)
        cta_barrier()
        arrived = gl.atomic_add(counters_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if arrived == n_splits - 1:
            MH: gl.constexpr = 1 if GQ <= 1 else (2 if GQ <= 2 else (4 if GQ <= 4 else (8 if GQ <= 8 else 16)))
            W0: gl.constexpr = MH if MH < 4 else 4
            MCH: gl.constexpr = 8192 // (MH * D) if 8192 // (MH * D) >= 4 // W0 else 4 // W0
            L3: gl.constexpr = gl.BlockedLayout([1, 1, D // 32], [1, 1, 32], [W0, 4 // W0, 1], [2, 1, 0])
            LS: gl.constexpr = gl.SliceLayout(2, L3)  # [MH, MCH]
            LO: gl.constexpr = gl.SliceLayout(1, L3)  # [MH, D]
            g = gl.arange(0, MH, layout=gl.SliceLayout(1, LS))
            k = gl.arange(0, MCH, layout=gl.SliceLayout(0, LS))
            dd = gl.arange(0, D, layout=gl.SliceLayout(0, LO))
            row = (bh * GQ + g).to(gl.int64) * n_splits  # partial rows of query heads b * H + h * GQ + g
            m = gl.full([MH], float("-inf"), gl.float32, gl.SliceLayout(1, LS))
            den = gl.zeros([MH], gl.float32, gl.SliceLayout(1, LS))
            acc = gl.zeros([MH, D], gl.float32, LO)
            for c0 in range(0, n_splits, MCH):
                ok = (g < GQ)[:, None] & (c0 + k < n_splits)[None, :]
                prow = row[:, None] + c0 + k[None, :]
                lse = gl.load(part_lse_ptr + prow, mask=ok, other=float("-inf"), cache_modifier=".cg")
                o = gl.load(part_o_ptr + (prow * D)[:, :, None] + dd[None, None, :], mask=ok[:, :, None],
                            other=0.0, cache_modifier=".cg")
                m_new = gl.maximum(m, gl.max(lse, axis=1))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m - m_use)
                w = gl.exp2(lse - m_use[:, None])
                den = den * alpha + gl.sum(w, axis=1)
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, LO))
                acc = acc * alpha_o[:, None] + gl.sum(w[:, :, None] * o, axis=1)
                m = m_new
            den_o = gl.convert_layout(den, gl.SliceLayout(1, LO))
            res = gl.where((den_o > 0.0)[:, None], acc / gl.where(den_o > 0.0, den_o, 1.0)[:, None], 0.0)
            go = gl.arange(0, MH, layout=gl.SliceLayout(1, LO))
            orow = (bh * GQ + go).to(gl.int64) * D
            gl.store(out_ptr + orow[:, None] + dd[None, :], res.to(out_ptr.dtype.element_ty), mask=(go < GQ)[:, None])
            gl.store(counters_ptr + bh, 0)


__all__ = ["merge_if_last"] if HAVE_GLUON else []
