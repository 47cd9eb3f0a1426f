"""The portable split kernel's page helpers (kernels/decode/portable_pages.py): ``window_block``, the one reader of
the BF16 sink and recent ring (the portable and the hopper split kernels call it), gives each chunk's rows and the
mask of the slots that hold a token, against ``reference.recent_valid``, for ring starts 0, P, 2P, 3P (wrapped),
more pages than the ring has slots, and a sink shorter than its chunk. The private page helpers are inlined into the
split kernel and tested through it (test_decode_portable.py). On the CPU through Triton's interpreter
(tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from oscar_export.kernels import reference as ref  # noqa: E402
from oscar_export.kernels.decode.portable_pages import window_block  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout, RowFormat  # noqa: E402
from oscar_export.kernels.transform import LayerTransform  # noqa: E402

from helpers import ragged_cache  # noqa: E402


@triton.jit
def _window_kernel(sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
                   k_out_ptr, v_out_ptr, mask_out_ptr, H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                   S0: tl.constexpr, RC: tl.constexpr, BN: tl.constexpr, NC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    tb = tl.arange(0, BN)
    kb, vb, tmask = window_block(sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr, sink_len_ptr, num_pages_ptr,
                                 recent_len_ptr, b, h, c, tb, H_KV, D, P, S0, RC, BN)
    dd = tl.arange(0, D)
    rows = tb[:, None] * D + dd[None, :]
    out = (((b * H_KV + h) * NC + c) * BN + tb)[:, None] * D + dd[None, :]
    tl.store(k_out_ptr + out, tl.load(kb + rows, mask=tmask[:, None], other=0.0))
    tl.store(v_out_ptr + out, tl.load(vb + rows, mask=tmask[:, None], other=0.0))
    tl.store(mask_out_ptr + ((b * H_KV + h) * NC + c) * BN + tb, tmask.to(tl.int32))


@pytest.mark.parametrize("bn", [16, 32])
def test_window_block_reads_the_sink_and_the_ring(pp_mod, device, bn):
    lay = KVCacheLayout(2, 64, RowFormat(64, 64), RowFormat(64, 64), sink=16, window=32, page_size=16)
    lengths = [0, 9, 16 + 32 + 16 + 5, 16 + 32 + 2 * 16 + 7, 16 + 48 + 3 * 16, 16 + 48 + 6 * 16 + 3]
    st = ragged_cache(lay, lengths, LayerTransform.identity(2, 64))
    assert sorted(set((st.num_pages * 16 % lay.recent_slots).tolist())) == [0, 16, 32, 48]  # ring starts
    assert int(st.num_pages.max()) * 16 > lay.recent_slots, "a ring start past one turn of the ring"
    nsink, nc = -(-lay.sink // bn), -(-lay.sink // bn) + -(-lay.recent_slots // bn)
    bsz, h, d = len(lengths), 2, 64
    k_out, v_out = (torch.full((bsz, h, nc, bn, d), 7.0, dtype=torch.bfloat16, device=device) for _ in range(2))
    mask = torch.full((bsz, h, nc, bn), -1, dtype=torch.int32, device=device)
    dev = {f: getattr(st, f).to(device) for f in ("sink_k", "sink_v", "recent_k", "recent_v", "sink_len",
                                                    "num_pages", "recent_len")}
    _window_kernel[(bsz, h, nc)](*dev.values(), k_out, v_out, mask, h, d, 16, lay.sink, lay.recent_slots, bn, nc)

    ring = ref.recent_valid(lay, st.num_pages, st.recent_len)  # [B, C]
    for c in range(nc):
        if c < nsink:
            idx = c * bn + torch.arange(bn)
            valid = idx[None, :] < torch.clamp(st.sink_len, max=lay.sink)[:, None]  # [B, BN]
            src_k, src_v = st.sink_k, st.sink_v
        else:
            idx = (c - nsink) * bn + torch.arange(bn)
            valid = (idx[None, :] < lay.recent_slots) & ring[:, idx.clamp(max=lay.recent_slots - 1)]
            src_k, src_v = st.recent_k, st.recent_v
        assert torch.equal(mask[:, :, c].cpu(), valid[:, None, :].expand(bsz, h, bn).int()), f"chunk {c}: mask"
        idx = idx.clamp(max=src_k.shape[2] - 1)
        for out, src, name in ((k_out, src_k, "K"), (v_out, src_v, "V")):
            want = torch.where(valid[:, None, :, None], src[:, :, idx], torch.zeros((), dtype=src.dtype))
            assert torch.equal(out[:, :, c].cpu(), want), f"chunk {c}: {name} rows"
    assert bool(mask[1:].any()) and not bool(mask[0].any()), "the empty sequence reads nothing, the others do"
