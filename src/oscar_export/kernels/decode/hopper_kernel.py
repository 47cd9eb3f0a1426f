"""Decode attention on Hopper: the mma16 split kernel in Gluon, the unpacked codes as the A operand of ``wgmma``.

Same interface, semantics and partials as the portable split kernel (:mod:`.portable`), same mma16 pages, and
two kernels over one body (:func:`_split_partial`): ``_decode_split_gl_kernel``, merged by ``splits.merge_kernel`` (the
launch plan's DECODE_SPLIT_GL, what AOT bundles carry), and ``_decode_split_merge_gl_kernel``, whose last program of
each (sequence, KV head) merges (DECODE_SPLIT_MERGE_GL, ``hopper_merge.merge_if_last``: one launch; the JIT default,
``GL_FUSED_MERGE``). The kernel owns its register layouts:

* one warpgroup (4 warps) per (sequence, KV head, split); every page dot is a Hopper ``warpgroup_mma`` with
  keys (``S^T [P, GQ_PAD] = K_c [P, D] · (q·s)^T``) or values (``O^T [D, GQ_PAD] += V_c^T [D, P] · (p·s_v)^T``)
  on the MMA's M and the GQA query heads on N, the B operand (queries, probabilities) K-major in shared memory
  (``[N, K]``, handed over as its ``[K, N]`` view: an MN-major ``[K, 8]`` B gave wrong products on the H200);
* a page's codes are loaded as uint16 halves in the layout where thread ``lane`` of warp ``w`` holds the words
  of row blocks ``w, w + 4, ...`` (``reference.pack_mma16``: one contiguous run per lane and row block), and
  each field of a word becomes one ``half2`` A register by one ``and.b32`` (fields 4..7 after one ``shr.b32``
  per word). ``a_operand`` (:mod:`.hopper_operands`, the page operands) rebuilds the logical ``[R, C]`` tile
  from the eight fields with joins, one permute and one reshape, and ``convert_layout(..., assert_trivial=True)``
  makes the compiler prove that this *is* the wgmma A layout: no data moves between the load and the MMA
  (compilation fails otherwise);
* the fields are fp16 subnormals ``c·4^(2hc + hr)·2^-24`` (exact): the ``4^-2hc`` of the
  K-dim bit 3 goes into the B operand rows (query dims, resp. tokens), the ``4^-hr`` of the M bit 3 and the
  ``2^24`` into the per-row scales (key tokens, resp. output dims) — all exact powers of two;
* the softmax state stays in the accumulator layout: the running max is one cross-warp reduction per page,
  the denominators and ``Σ p·lo`` are kept per element and reduced once after the last page;
* the pages stream through ``STAGES`` shared-memory stages by ``cp.async`` (codes, token param words, channel
  params), ``STAGES - 1`` pages ahead of the one computed: no synchronous global load in the page loop.

The BF16 sink / recent chunks (``s >= n_page_splits``) use the same warpgroup MMAs on operands converted
through shared memory (a few chunks per sequence, not the hot loop).

4-bit key pages (``KEY_BITS`` 4, ``reference.pack_mma16(..., bits=4)``: a word holds one 16x16 tile's fragment) take
the same path with four nibble fields a word (``a_operand4``: ``c·16^hr·2^-24``, the ``hc`` field by the ``shr``,
so the query rows carry no power of two), twice the code bytes a page in the cp.async stages.

head_dim 256 with two token groups of 128 a row (the default layout there, Gemma 3; ``NG`` 2): each 128-column key
chunk's scores are scaled by its own group's ``(scale, lo)`` (two MMAs, two accumulators) and the value MMA is split
into the two halves of the dims, each with its group's ``p·s_v`` in its own shared-memory B operand. Compiled for
sm_90 without spills, its arithmetic checked on the CPU (:func:`.hopper_emulation.emulate`) and on a GPU
(``tests/gpu/test_kernels_gpu.py::test_decode_attention_gluon_two_groups_head_dim_256``):
``checks.check_hopper_layout`` accepts two groups a row.

Limits: uniform codes (``K_CODEBOOK``/``V_CODEBOOK`` False; 2-bit values, 2- or 4-bit keys), token or channel keys,
``P`` 64 or 128, ``D`` 64, 128 or 256, ``GQ_PAD`` 8 or 16, ``num_warps`` 4; ``checks.check_hopper_layout`` refuses the
rest.
``FAST_UNPACK`` is accepted for the portable kernel's signature and ignored (the field masks are always PTX: CUDA only).

Compiled for sm_90 by Triton 3.9 (CI) and 3.6 (the GPU image's) on the CPU, with every A-operand conversion proven
trivial by the compiler (``tests/kernels/test_decode_hopper_kernel.py``). Hopper only
(``checks.check_hopper_device``). On a GPU (Triton 3.6): ``tests/gpu/test_kernels_gpu.py -k gluon`` passes and,
launched as the plan says (``launch_plan.gl_occupancy``: 128 registers a thread at head_dim <= 128;
``gl_pages_per_split``: whole waves; the merge fused), it is the fastest decode kernel at every measured shape
(``docs/kernels.md``, "Why the launch parameters are what they are"). There is no CPU interpreter for Gluon:
the CPU check of its algorithm is :func:`.hopper_emulation.emulate` (the same folding of scales and powers of two, in
PyTorch, against ``reference.decode_attention``).
"""

from __future__ import annotations

from ..aot import launch_plan as _plan
from .gluon_names import HAVE_GLUON, async_copy, cp_async, cta_barrier, fence_async_shared, gl, gluon, warpgroup_mma
from .portable_pages import window_block

if HAVE_GLUON:
    from .hopper_merge import merge_if_last  # the fused merge of the last program
    from .hopper_operands import a_operand, a_operand4, word_offsets, word_offsets4  # the page operands

#: the split kernel's cp.async page stages (the launch plan's; its one warpgroup a program: DECODE_SPLIT_GL.num_warps).
STAGES = _plan.GL_PAGE_STAGES


if HAVE_GLUON:

    @gluon.jit
    def _bit3_scale(n: gl.constexpr, small: gl.constexpr, layout: gl.constexpr):
        """``[n]`` fp32: ``small`` where bit 3 of the index is set, else 1 (the exact powers of two of the fields)."""
        i = gl.arange(0, n, layout=layout)
        return gl.where((i // 8) % 2 == 1, small, 1.0)

    @gluon.jit
    def _query(q_ptr, b, h, H_KV: gl.constexpr, GQ: gl.constexpr, GQ_PAD: gl.constexpr, D: gl.constexpr,
               SM_SCALE: gl.constexpr, QL: gl.constexpr):
        """The ``GQ`` query heads of KV head ``h`` (in the stored key basis; rows past ``GQ`` zero), times
        ``sm_scale·log2(e)``: fp32 ``[GQ_PAD, D]`` in ``QL``."""
        H: gl.constexpr = H_KV * GQ
        g = gl.arange(0, GQ_PAD, layout=gl.SliceLayout(1, QL))
        dd = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
        qrow = (b * H + h * GQ + g).to(gl.int64) * D
        qf = gl.load(q_ptr + qrow[:, None] + dd[None, :], mask=(g < GQ)[:, None], other=0.0).to(gl.float32)
        qscale: gl.constexpr = SM_SCALE * 1.4426950408889634
        return (qf * qscale).to(gl.float16).to(gl.float32)

    @gluon.jit
    def _token_pair(w):
        """Per-token fp16 ``(scale, lo)`` from their 32-bit words (the scale in the low half), as fp32."""
        scale = (w & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        lo = (w >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        return scale, lo

    @gluon.jit
    def _window_chunk(qw_s, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr, num_pages_ptr,
                      recent_len_ptr, b, h, c, H_KV: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
                      S0: gl.constexpr, RC: gl.constexpr, BN: gl.constexpr, GQ_PAD: gl.constexpr,
                      MMA: gl.constexpr, A_L: gl.constexpr):
        """Attention over BF16 chunk ``c`` (addressed by the portable kernel's ``window_block``: sink chunks first, then
        the recent ring): ``m, den [GQ_PAD]`` (log2 units) and the unnormalised ``O^T [D, GQ_PAD]``."""
        LK: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        tb = gl.arange(0, BN, layout=gl.SliceLayout(1, LK))
        dd = gl.arange(0, D, layout=gl.SliceLayout(0, LK))
        kb, vb, tmask = window_block(sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr, num_pages_ptr,
                                     recent_len_ptr, b, h, c, tb, H_KV, D, P, S0, RC, BN)  # portable kernel's
        rows = tb[:, None] * D + dd[None, :]
        kk = gl.load(kb + rows, mask=tmask[:, None], other=0.0).to(gl.float16)  # [BN, D]
        vv = gl.load(vb + rows, mask=tmask[:, None], other=0.0).to(gl.float16)
        st = warpgroup_mma(gl.convert_layout(kk, A_L), qw_s.permute((1, 0)), gl.zeros([BN, GQ_PAD], gl.float32, MMA))
        tm = gl.convert_layout(tmask, gl.SliceLayout(1, MMA))
        st = gl.where(tm[:, None], st, float("-inf"))
        m = gl.max(st, axis=0)
        m_use = gl.where(m == float("-inf"), 0.0, m)
        pt = gl.exp2(st - m_use[None, :])
        den = gl.sum(pt, axis=0)
        PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GQ_PAD, BN], gl.float16)
        p_s = gl.allocate_shared_memory(gl.float16, [GQ_PAD, BN], PS, gl.permute(pt.to(gl.float16), [1, 0]))
        fence_async_shared()
        cta_barrier()
        vt = gl.convert_layout(gl.permute(vv, [1, 0]), A_L)  # [D, BN]
        out_t = warpgroup_mma(vt, p_s.permute((1, 0)), gl.zeros([D, GQ_PAD], gl.float32, MMA))
        return m, den, out_t

    @gluon.jit
    def _issue_page(kbuf, vbuf, tbuf, cbuf, k16, v16, k_params_ptr, vp32, block_table_ptr, b, pg, end, it,
                    max_pages, h, koffs, voffs, K_CHANNEL: gl.constexpr, H_KV: gl.constexpr, P: gl.constexpr,
                    D: gl.constexpr, KC: gl.constexpr, STAGES: gl.constexpr, KEY_BITS: gl.constexpr,
                    NG: gl.constexpr):
        """cp.async the K and V codes of page ``pg`` of sequence ``b`` (zeros if ``pg >= end``) into stage
        ``it % STAGES`` with its params: the V per-token words and the K ones (token keys) into ``tbuf`` (row
        ``(2 st + kv) NG + g`` for group ``g`` of ``NG`` a row), or the K channel ``[2, D]`` scales and lows into
        ``cbuf`` (channel keys); committed as one group."""
        ok = pg < end
        page = gl.load(block_table_ptr + b.to(gl.int64) * max_pages + pg, mask=ok, other=0).to(gl.int64)
        half_off = gl.multiple_of((page * H_KV + h) * (P * D // 8), 8)  # uint16 units; pages are 16-byte aligned
        khalf_off = gl.multiple_of((page * H_KV + h) * (P * D * KEY_BITS // 16), 8)
        NCH: gl.constexpr = D // KC
        KH: gl.constexpr = KC * KEY_BITS // 32  # uint16 halves of a chunk's row block a lane holds
        st = it % STAGES
        for ch in gl.static_range(NCH):
            cp_async(kbuf.index(st * NCH + ch), k16 + khalf_off + koffs + ch * KH, mask=ok)
        cp_async(vbuf.index(st), v16 + half_off + voffs, mask=ok)
        LP: gl.constexpr = gl.BlockedLayout([P // 128 if P >= 128 else 1], [32], [4], [0])
        t = gl.arange(0, P, layout=LP)
        word_off = (page * H_KV + h) * (P * NG)
        if K_CHANNEL:  # rows 2 st (scales) and 2 st + 1 (lows) of cbuf
            LC: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])  # 16 bytes a thread (replicated past D)
            dc = gl.arange(0, D, layout=LC)
            pw = k_params_ptr + (page * H_KV + h) * (2 * D) + dc
            cp_async(cbuf.index(2 * st), pw, mask=ok)
            cp_async(cbuf.index(2 * st + 1), pw + D, mask=ok)
        else:
            for g in gl.static_range(NG):
                cp_async(tbuf.index(2 * st * NG + g),
                          k_params_ptr.to(gl.pointer_type(gl.int32)) + word_off + t * NG + g, mask=ok)
        for g in gl.static_range(NG):
            cp_async(tbuf.index((2 * st + 1) * NG + g), vp32 + word_off + t * NG + g, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _split_partial(
        q_ptr, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
        k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, block_table_ptr, sink_len_ptr, num_pages_ptr,
        recent_len_ptr, part_o_ptr, part_lse_ptr, max_pages, pages_per_split, n_page_splits, n_splits,
        H_KV: gl.constexpr, GQ: gl.constexpr, GQ_PAD: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
        S0: gl.constexpr, RC: gl.constexpr, BN: gl.constexpr, SM_SCALE: gl.constexpr,
        K_CHANNEL: gl.constexpr, K_CODEBOOK: gl.constexpr, V_CODEBOOK: gl.constexpr,
        STAGES: gl.constexpr, KEY_BITS: gl.constexpr, NG: gl.constexpr,
    ):
        """The body of both split kernels: this program's partial (out / den and log2-sum-exp) into ``part_o`` /
        ``part_lse``. ``NG``: token groups a row (keys at token granularity, values), 1, or 2 at ``D = 256``
        (``G = 128``, one key chunk a group: each chunk's scores scaled by its own group, the value MMA split
        into the two halves of the dims, each with its group's ``p·s_v``)."""
        gl.static_assert(NG == 1 or (NG == 2 and D == 256), "hopper kernel: 1 token group a row, or 2 at D 256")
        gl.static_assert(KEY_BITS == 2 or KEY_BITS == 4, "hopper kernel: 2- or 4-bit key pages")
        gl.static_assert(not K_CODEBOOK and not V_CODEBOOK, "hopper kernel: uniform codes only")
        gl.static_assert(gl.num_warps() == 4, "hopper kernel: one warpgroup (num_warps=4)")
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, GQ_PAD, 16])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)  # per token / per output dim
        COL: gl.constexpr = gl.SliceLayout(0, MMA)  # per query head
        QL: gl.constexpr = gl.BlockedLayout([1, 4], [GQ_PAD // 4, 128 // GQ_PAD], [4, 1], [1, 0])  # [GQ_PAD, D]
        # B operands K-major in shared memory ([N, K], K contiguous) and handed over as their [K, N] view: on the
        # H200 (Triton 3.6) an MN-major [K, 8] B gave wrong products for K = 128 (dbg: one-hot B, mma16 A exact)
        QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GQ_PAD, D], gl.float16)
        PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GQ_PAD, P], gl.float16)
        KC: gl.constexpr = D if D < 128 else 128  # key columns per A operand (registers: KC / 2 per thread)
        KH: gl.constexpr = KC * KEY_BITS // 32  # uint16 halves of a key chunk's row block a lane holds
        LWK: gl.constexpr = gl.BlockedLayout([1, KH], [32, 1], [4, 1], [1, 0])
        LWV: gl.constexpr = gl.BlockedLayout([1, P // 16], [32, 1], [4, 1], [1, 0])
        H: gl.constexpr = H_KV * GQ

        bh = gl.program_id(0)
        s = gl.program_id(1)
        b = bh // H_KV
        h = bh % H_KV
        if s < n_page_splits:
            if KEY_BITS == 4:
                koffs = word_offsets4(P, D, 0, KC, LWK)  # chunk ch: + ch * KH (KC // 16 words of each row block)
            else:
                koffs = word_offsets(P, D, 0, KC, LWK)  # chunk ch: + ch * KH (KC // 32 words of each row block)
            voffs = word_offsets(D, P, 0, P, LWV)
            k16 = k_codes_ptr.to(gl.pointer_type(gl.uint16))
            v16 = v_codes_ptr.to(gl.pointer_type(gl.uint16))
            # the page codes stream through STAGES shared-memory stages (cp.async, STAGES - 1 pages ahead)
            NCH: gl.constexpr = D // KC
            CS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # lane-contiguous rows: conflict-free
            kbuf = gl.allocate_shared_memory(gl.uint16, [STAGES * NCH, P // 16 * 32, KH], CS)
            vbuf = gl.allocate_shared_memory(gl.uint16, [STAGES, D // 16 * 32, P // 16], CS)
            tbuf = gl.allocate_shared_memory(gl.int32, [STAGES * 2 * NG, P], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            if K_CHANNEL:  # the page's channel scales and lows, fp16 rows
                cbuf = gl.allocate_shared_memory(gl.float16, [STAGES * 2, D], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            else:
                cbuf = tbuf  # not read
            vp32 = v_params_ptr.to(gl.pointer_type(gl.int32))
            start = s * pages_per_split
            end = gl.minimum(start + pages_per_split, gl.load(num_pages_ptr + b))
            for i in gl.static_range(STAGES - 1):
                _issue_page(kbuf, vbuf, tbuf, cbuf, k16, v16, k_params_ptr, vp32, block_table_ptr, b, start + i, end,
                            i, max_pages, h, koffs, voffs, K_CHANNEL, H_KV, P, D, KC, STAGES, KEY_BITS, NG)
            # the first pages are in flight while the query is loaded
            q32 = _query(q_ptr, b, h, H_KV, GQ, GQ_PAD, D, SM_SCALE, QL)  # [GQ_PAD, D]
            # 4^-2hc of the 2-bit key fields (K dim = dims); 4-bit fields have none (hc is shifted down)
            hc_q = _bit3_scale(D, 0.0625 if KEY_BITS == 2 else 1.0, gl.SliceLayout(0, QL))
            qsum = gl.convert_layout(gl.sum(q32, axis=1), COL)  # [GQ_PAD]
            qk_s = gl.allocate_shared_memory(gl.float16, [GQ_PAD, D], QS, (q32 * hc_q[None, :]).to(gl.float16))
            p_s = gl.allocate_shared_memory(gl.float16, [GQ_PAD, P], PS)
            DG: gl.constexpr = D // NG  # the output dims of one value group
            if NG == 2:  # each group's query sum (its keys' lows) and p·s_v (its values)
                first = (gl.arange(0, D, layout=gl.SliceLayout(0, QL)) < DG)[None, :]
                qsum = gl.convert_layout(gl.sum(gl.where(first, q32, 0.0), axis=1), COL)
                qsum1 = gl.convert_layout(gl.sum(gl.where(first, 0.0, q32), axis=1), COL)
                p_s1 = gl.allocate_shared_memory(gl.float16, [GQ_PAD, P], PS)
            fence_async_shared()
            hr_k = _bit3_scale(P, 0.25 if KEY_BITS == 2 else 0.0625, ROW) * 16777216.0  # 2^24·4^-hr (16^-hr) per token
            hc_v = _bit3_scale(P, 0.0625, ROW)  # 4^-2hc of the value fields (K dim = tokens)
            m = gl.full([GQ_PAD], float("-inf"), gl.float32, COL)
            l_acc = gl.zeros([P, GQ_PAD], gl.float32, MMA)
            lo_acc = gl.zeros([P, GQ_PAD], gl.float32, MMA)
            acc = gl.zeros([DG, GQ_PAD], gl.float32, MMA)  # O^T (of the first value group's dims)
            if NG == 2:
                lo_acc1 = gl.zeros([P, GQ_PAD], gl.float32, MMA)
                acc1 = gl.zeros([DG, GQ_PAD], gl.float32, MMA)
            for pg in range(start, end):
                it = pg - start
                async_copy.wait_group(STAGES - 2)  # this thread's copies of page pg have landed
                cta_barrier()  # ... everyone's; and stage (it - 1) % STAGES is free again
                _issue_page(kbuf, vbuf, tbuf, cbuf, k16, v16, k_params_ptr, vp32, block_table_ptr, b, pg + STAGES - 1,
                            end, it + STAGES - 1, max_pages, h, koffs, voffs, K_CHANNEL, H_KV, P, D, KC, STAGES,
                            KEY_BITS, NG)
                stage = it % STAGES
                if K_CHANNEL:
                    ksc = cbuf.index(2 * stage).load(gl.SliceLayout(0, QL)).to(gl.float32)
                    klo = cbuf.index(2 * stage + 1).load(gl.SliceLayout(0, QL)).to(gl.float32)
                    qk_s.store((q32 * (ksc * hc_q)[None, :]).to(gl.float16))
                    fence_async_shared()
                    const = gl.convert_layout(gl.sum(q32 * klo[None, :], axis=1), COL)
                else:
                    ks, klo_t = _token_pair(tbuf.index(2 * stage * NG).load(ROW))
                    if NG == 2:
                        ks1, klo1 = _token_pair(tbuf.index(2 * stage * NG + 1).load(ROW))
                vs, vlo = _token_pair(tbuf.index((2 * stage + 1) * NG).load(ROW))
                if NG == 2:
                    vs1, vlo1 = _token_pair(tbuf.index((2 * stage + 1) * NG + 1).load(ROW))
                if K_CHANNEL or NG == 1:
                    st = gl.zeros([P, GQ_PAD], gl.float32, MMA)
                    for ch in gl.static_range(NCH):
                        if KEY_BITS == 4:
                            a = a_operand4(kbuf.index(stage * NCH + ch).load(LWK), P, KC, A_L)
                        else:
                            a = a_operand(kbuf.index(stage * NCH + ch).load(LWK), P, KC, A_L)
                        st = warpgroup_mma(a, qk_s.slice(ch * KC, KC, dim=1).permute((1, 0)), st)
                    if K_CHANNEL:
                        st = st * hr_k[:, None] + const[None, :]
                    else:
                        st = st * (ks * hr_k)[:, None] + klo_t[:, None] * qsum[None, :]
                else:  # two token key groups, one 128-column chunk each: each chunk's scores by its own scale
                    if KEY_BITS == 4:
                        a = a_operand4(kbuf.index(stage * NCH).load(LWK), P, KC, A_L)
                    else:
                        a = a_operand(kbuf.index(stage * NCH).load(LWK), P, KC, A_L)
                    st = warpgroup_mma(a, qk_s.slice(0, KC, dim=1).permute((1, 0)),
                                       gl.zeros([P, GQ_PAD], gl.float32, MMA))
                    st = st * (ks * hr_k)[:, None] + klo_t[:, None] * qsum[None, :]
                    if KEY_BITS == 4:
                        a = a_operand4(kbuf.index(stage * NCH + 1).load(LWK), P, KC, A_L)
                    else:
                        a = a_operand(kbuf.index(stage * NCH + 1).load(LWK), P, KC, A_L)
                    st1 = warpgroup_mma(a, qk_s.slice(KC, KC, dim=1).permute((1, 0)),
                                        gl.zeros([P, GQ_PAD], gl.float32, MMA))
                    st = st + st1 * (ks1 * hr_k)[:, None] + klo1[:, None] * qsum1[None, :]
                m_new = gl.maximum(m, gl.max(st, axis=0))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m - m_use)
                pt = gl.exp2(st - m_use[None, :])  # [P, GQ_PAD]
                m = m_new
                l_acc = l_acc * alpha[None, :] + pt
                lo_acc = lo_acc * alpha[None, :] + pt * vlo[:, None]
                p_s.store(gl.permute((pt * (vs * hc_v)[:, None]).to(gl.float16), [1, 0]))
                if NG == 2:
                    lo_acc1 = lo_acc1 * alpha[None, :] + pt * vlo1[:, None]
                    p_s1.store(gl.permute((pt * (vs1 * hc_v)[:, None]).to(gl.float16), [1, 0]))
                fence_async_shared()
                if NG == 2:  # the value rows (dims) of each group: its half of the page's row blocks
                    HR: gl.constexpr = DG // 16 * 32
                    a_v = a_operand(vbuf.index(stage).slice(0, HR, dim=0).load(LWV), DG, P, A_L)
                    acc = warpgroup_mma(a_v, p_s.permute((1, 0)), acc * alpha[None, :])
                    a_v1 = a_operand(vbuf.index(stage).slice(HR, HR, dim=0).load(LWV), DG, P, A_L)
                    acc1 = warpgroup_mma(a_v1, p_s1.permute((1, 0)), acc1 * alpha[None, :])
                else:
                    a_v = a_operand(vbuf.index(stage).load(LWV), D, P, A_L)
                    acc = warpgroup_mma(a_v, p_s.permute((1, 0)), acc * alpha[None, :])
            async_copy.wait_group(0)  # no copy outlives the program
            den = gl.sum(l_acc, axis=0)
            lo = gl.sum(lo_acc, axis=0)
            out_t = acc * (_bit3_scale(DG, 0.25, ROW) * 16777216.0)[:, None] + lo[None, :]  # 2^24·4^-hr per dim
            if NG == 2:  # [DG, GQ_PAD] x 2 -> [2, DG, GQ_PAD] -> [D, GQ_PAD], in the windows' layout
                out1 = acc1 * (_bit3_scale(DG, 0.25, ROW) * 16777216.0)[:, None] + gl.sum(lo_acc1, axis=0)[None, :]
                out_t = gl.convert_layout(gl.reshape(gl.permute(gl.join(out_t, out1), [2, 0, 1]), [D, GQ_PAD]), MMA)
        else:
            q32 = _query(q_ptr, b, h, H_KV, GQ, GQ_PAD, D, SM_SCALE, QL)
            qw_s = gl.allocate_shared_memory(gl.float16, [GQ_PAD, D], QS, q32.to(gl.float16))
            fence_async_shared()
            cta_barrier()
            m, den, out_t = _window_chunk(qw_s, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr,
                                        num_pages_ptr, recent_len_ptr, b, h, s - n_page_splits, H_KV, D, P, S0,
                                        RC, BN, GQ_PAD, MMA, A_L)
        # partials: out / den and log2-sum-exp (-inf and zeros when nothing was attended), rows g < GQ
        g = gl.arange(0, GQ_PAD, layout=COL)
        dd = gl.arange(0, D, layout=ROW)
        nonempty = den > 0.0
        inv = gl.where(nonempty, 1.0 / gl.where(nonempty, den, 1.0), 0.0)
        lse = gl.where(nonempty, m + gl.log2(gl.where(nonempty, den, 1.0)), float("-inf"))
        prow = (b * H + h * GQ + g).to(gl.int64) * n_splits + s
        gl.store(part_lse_ptr + prow, lse, mask=g < GQ)
        gl.store(part_o_ptr + prow[None, :] * D + dd[:, None], out_t * inv[None, :], mask=(g < GQ)[None, :])

    @gluon.jit
    def _decode_split_gl_kernel(
        q_ptr,
        sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
        k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
        block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
        part_o_ptr, part_lse_ptr,
        max_pages, pages_per_split, n_page_splits, n_splits,
        H_KV: gl.constexpr, GQ: gl.constexpr, GQ_PAD: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
        S0: gl.constexpr, RC: gl.constexpr, BN: gl.constexpr, SM_SCALE: gl.constexpr,
        K_CHANNEL: gl.constexpr, K_CODEBOOK: gl.constexpr, V_CODEBOOK: gl.constexpr,
        FAST_UNPACK: gl.constexpr, STAGES: gl.constexpr, KEY_BITS: gl.constexpr = 2, NG: gl.constexpr = 1,
    ):
        """Partial attention of one (sequence, KV head, split) over mma16 pages; parameters, grid and partials
        those of the portable split kernel plus ``STAGES`` (the launch plan's DECODE_SPLIT_GL): ``q_ptr`` the
        queries in the stored key basis. Uniform codes only
        (``K_CODEBOOK``/``V_CODEBOOK`` must be False: ``checks.check_hopper_layout``)."""
        _split_partial(q_ptr, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, k_codes_ptr, k_params_ptr,
                       v_codes_ptr, v_params_ptr, block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
                       part_o_ptr, part_lse_ptr, max_pages, pages_per_split, n_page_splits, n_splits,
                       H_KV, GQ, GQ_PAD, D, P, S0, RC, BN, SM_SCALE, K_CHANNEL, K_CODEBOOK, V_CODEBOOK,
                       STAGES, KEY_BITS, NG)

    @gluon.jit
    def _decode_split_merge_gl_kernel(
        q_ptr,
        sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
        k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
        block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
        part_o_ptr, part_lse_ptr, out_ptr, counters_ptr,
        max_pages, pages_per_split, n_page_splits, n_splits,
        H_KV: gl.constexpr, GQ: gl.constexpr, GQ_PAD: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
        S0: gl.constexpr, RC: gl.constexpr, BN: gl.constexpr, SM_SCALE: gl.constexpr,
        K_CHANNEL: gl.constexpr, K_CODEBOOK: gl.constexpr, V_CODEBOOK: gl.constexpr,
        FAST_UNPACK: gl.constexpr, STAGES: gl.constexpr, KEY_BITS: gl.constexpr = 2, NG: gl.constexpr = 1,
    ):
        """:func:`_decode_split_gl_kernel` with the merge in its last program (:func:`merge_if_last`): one launch
        for the whole decode attention. ``out_ptr [B, H, D]`` (fp32 / bf16 / fp16), ``counters_ptr`` int32 ``[>=
        B * H_KV]``, zero at launch and left zero (``hopper.merge_counters``)."""
        _split_partial(q_ptr, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, k_codes_ptr, k_params_ptr,
                       v_codes_ptr, v_params_ptr, block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
                       part_o_ptr, part_lse_ptr, max_pages, pages_per_split, n_page_splits, n_splits,
                       H_KV, GQ, GQ_PAD, D, P, S0, RC, BN, SM_SCALE, K_CHANNEL, K_CODEBOOK, V_CODEBOOK,
                       STAGES, KEY_BITS, NG)
        merge_if_last(part_o_ptr, part_lse_ptr, out_ptr, counters_ptr, n_splits, H_KV, GQ, D)

    KERNEL = _decode_split_gl_kernel
    FUSED_KERNEL = _decode_split_merge_gl_kernel
else:  # pragma: no cover
    KERNEL = FUSED_KERNEL = None


__all__ = ["FUSED_KERNEL", "HAVE_GLUON", "KERNEL", "STAGES"]
