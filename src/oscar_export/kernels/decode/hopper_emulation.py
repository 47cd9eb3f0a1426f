"""The hopper decode kernel's arithmetic in PyTorch, for the CPU: Gluon has no interpreter, so this is where its
algorithm is checked without a GPU (``tests/kernels/test_decode_hopper_emulation.py``; the kernel against it on the
H200: ``tests/gpu/test_kernels_gpu.py::test_decode_attention_gluon_matches_its_emulation``).

:func:`emulate_a_operand` rebuilds a page's A operand the way the kernel does (:mod:`.hopper_operands`'s
``word_offsets`` / ``a_operand``: the uint16 halves, the field masks read as fp16 bits, joins, permute, reshape);
:func:`emulate` is the whole decode in float64 on those operands, with the kernel's folding of scales and powers of
two and its fp16 roundings, against ``reference.decode_attention``.
"""

from __future__ import annotations

import torch

from .. import reference
from ..layout import KVCacheLayout


def emulate_a_operand(page: torch.Tensor, rows: int, cols: int, c0: int = 0, ct: int | None = None,
                      bits: int = 2) -> torch.Tensor:
    """``hopper_operands.a_operand`` of ``word_offsets`` in PyTorch, step by step: the uint16 halves of columns ``c0
    .. c0 + ct`` of one page's ``[rows, cols]`` mma16 matrix (``page``: its bytes), the eight fields masked and read
    as fp16 bits, joined, permuted and reshaped in the kernel's order. Returns the fp16 ``[rows, ct]`` operand
    (``code·4^(2hc + hr)·2^-24``). ``bits=4``: ``a_operand4`` of ``word_offsets4`` (``code·16^hr·2^-24``)."""
    ct = cols if ct is None else ct
    if bits == 4:
        return _emulate_a_operand4(page, rows, cols, c0, ct)
    mb0 = 128 // cols if cols < 128 else 1
    mb = mb0 if (rows // 16) % mb0 == 0 else 1
    t = torch.arange(rows // 16 * 32)
    rb, lane = t // 32, t % 32
    word = (((rb // mb) * 32 + lane) * mb + rb % mb) * (cols // 32) + c0 // 32
    offs = 2 * word[:, None] + torch.arange(ct // 16)[None, :]
    halves = page.contiguous().view(torch.int16).long() & 0xFFFF
    h = halves[offs]  # [R/16 * 32, CT/16]
    h8 = h >> 8
    x = h.reshape(rows // 16, 8, 4, ct // 32, 2)
    x8 = h8.reshape(rows // 16, 8, 4, ct // 32, 2)
    field = lambda v, j: (v & (3 << (2 * j))).to(torch.int16).view(torch.float16)  # noqa: E731
    join = lambda a, b: torch.stack([a, b], dim=-1)  # noqa: E731  (gl.join: a new minor axis of size 2)
    j0 = join(join(field(x, 0), field(x, 1)), join(field(x, 2), field(x, 3)))
    j1 = join(join(field(x8, 0), field(x8, 1)), join(field(x8, 2), field(x8, 3)))
    j = join(j0, j1).permute(0, 5, 1, 3, 7, 6, 2, 4)
    return j.reshape(rows, ct)


def _emulate_a_operand4(page: torch.Tensor, rows: int, cols: int, c0: int, ct: int) -> torch.Tensor:
    mb0 = 64 // cols if cols < 64 else 1
    mb = mb0 if (rows // 16) % mb0 == 0 else 1
    t = torch.arange(rows // 16 * 32)
    rb, lane = t // 32, t % 32
    word = (((rb // mb) * 32 + lane) * mb + rb % mb) * (cols // 16) + c0 // 16
    offs = 2 * word[:, None] + torch.arange(ct // 8)[None, :]
    h = (page.contiguous().view(torch.int16).long() & 0xFFFF)[offs]  # [R/16 * 32, CT/8]
    x = h.reshape(rows // 16, 8, 4, ct // 16, 2)
    x8 = (h >> 8).reshape(rows // 16, 8, 4, ct // 16, 2)
    nib = lambda v, j: (v & (15 << (4 * j))).to(torch.int16).view(torch.float16)  # noqa: E731
    join = lambda a, b: torch.stack([a, b], dim=-1)  # noqa: E731
    j = join(join(nib(x, 0), nib(x, 1)), join(nib(x8, 0), nib(x8, 1))).permute(0, 5, 1, 3, 6, 2, 4)
    return j.reshape(rows, ct)


def _bit3(n: int, small: float) -> torch.Tensor:
    return torch.where((torch.arange(n) // 8) % 2 == 1, small, 1.0).double()


def emulate(q, state, layout: KVCacheLayout, scale: float) -> torch.Tensor:
    """The Gluon kernel's arithmetic in PyTorch for the CPU (float64 products of the kernel's fp16 operands): the
    page operands from :func:`emulate_a_operand`, the ``4^-2hc`` folded into the query dims (keys) and the
    probabilities' token rows (values), ``2^24·4^-hr`` into the per-token key scales and the per-dim outputs,
    the queries rounded to fp16 after ``sm_scale·log2(e)``, ``p·s_v`` rounded to fp16. One softmax over the
    sequence (split + merge: the portable kernel's). Token or channel keys, uniform 2-bit codes (4-bit key
    pages: ``16^-hr`` per token, nothing on the dims), one token group a row or two (``NG``: each key chunk scaled by
    its group, each half of the value dims by its group's ``p·s_v``), queries in the stored basis. Returns ``[B, H,
    D]`` float32 in the stored value basis."""
    bsz, hq, d = q.shape
    hkv, p, kbits = layout.num_kv_heads, layout.page_size, layout.key.bits
    ng = d // layout.value.group_size
    dg = d // ng
    gq = hq // hkv
    qs = (q.double() * (scale * 1.4426950408889634)).half().double()
    hc_d, hc_t = _bit3(d, 0.0625 if kbits == 2 else 1.0), _bit3(p, 0.0625)
    hr_t, hr_d = _bit3(p, 0.25 if kbits == 2 else 0.0625) * 2.0 ** 24, _bit3(d, 0.25) * 2.0 ** 24
    out = torch.zeros(bsz, hq, d, dtype=torch.float32)
    for bi in range(bsz):
        for hi in range(hkv):
            qh = qs[bi, hi * gq:(hi + 1) * gq]  # [GQ, D]
            parts = []  # (scores [T, GQ], value operand [D, T], probability factor [T], lo [T] or None)
            for pi in range(int(state.num_pages[bi])):
                page = int(state.block_table[bi, pi])
                a_k = emulate_a_operand(state.k_codes[page, hi].reshape(-1), p, d, bits=kbits).double()  # [P, D]
                a_v = emulate_a_operand(state.v_codes[page, hi].reshape(-1), d, p).double()  # [D, P]
                kp, vp = state.k_params[page, hi].double(), state.v_params[page, hi].double()
                if layout.key.granularity == "channel":
                    qk = (qh * (kp[0] * hc_d)[None, :]).half().double()
                    st = (a_k @ qk.T) * hr_t[:, None] + (qh * kp[1][None, :]).sum(1)[None, :]
                else:
                    kp = kp.reshape(p, ng, 2)
                    qk = (qh * hc_d[None, :]).half().double()
                    st = sum((a_k[:, g * dg:(g + 1) * dg] @ qk[:, g * dg:(g + 1) * dg].T)
                             * (kp[:, g, 0] * hr_t)[:, None]
                             + kp[:, g, 1][:, None] * qh[:, g * dg:(g + 1) * dg].sum(1)[None, :] for g in range(ng))
                vp = vp.reshape(p, ng, 2)
                parts.append((st, a_v * hr_d[:, None], vp[:, :, 0] * hc_t[:, None], vp[:, :, 1]))
            for w_k, w_v in _windows(state, layout, bi, hi):
                st = w_k.half().double() @ qh.half().double().T
                parts.append((st, w_v.half().double().T, None, None))
            if sum(st.shape[0] for st, *_ in parts) == 0:
                continue  # an empty sequence stays zeros, as the merge writes it
            m = torch.cat([st for st, *_ in parts]).max(0).values  # [GQ]
            num = torch.zeros(d, gq, dtype=torch.float64)
            den = torch.zeros(gq, dtype=torch.float64)
            for st, a_v, vs, vlo in parts:
                pt = torch.exp2(st - m[None, :])
                den += pt.sum(0)
                if vs is None:  # BF16 window
                    num += a_v @ pt.half().double()
                else:  # each group's dims: its rows of the operand times its p·s_v, plus its Σ p·lo
                    for g in range(ng):
                        num[g * dg:(g + 1) * dg] += (a_v[g * dg:(g + 1) * dg] @ (pt * vs[:, g, None]).half().double()
                                                     + (pt * vlo[:, g, None]).sum(0)[None, :])
            out[bi, hi * gq:(hi + 1) * gq] = (num / den[None, :]).T.float()
    return out


def _windows(state, layout: KVCacheLayout, bi: int, hi: int):
    """The cached BF16 sink and recent tokens of sequence ``bi``, KV head ``hi``: ``[(K, V), (K, V)]`` (the ring's
    slots by ``reference.recent_valid``, in slot order: attention does not care)."""
    s_len = min(int(state.sink_len[bi]), layout.sink)
    ring = reference.recent_valid(layout, state.num_pages, state.recent_len)[bi]
    return [(state.sink_k[bi, hi, :s_len], state.sink_v[bi, hi, :s_len]),
            (state.recent_k[bi, hi][ring], state.recent_v[bi, hi][ring])]


__all__ = ["emulate", "emulate_a_operand"]
