"""The TensorRT-order decode kernels (kernels/aot/trt_order.py), launched as their launch plans say
(``TRT_DECODE_SPLIT`` / ``TRT_DECODE_MERGE``: input tensors, int32 extras, output tensors), give the portable
wrapper's output bitwise: the same kernels behind another parameter order. On the CPU through Triton's interpreter
(tests/kernels/conftest.py); the bundle's compiled TensorRT kernels on the H200: tests/gpu/test_aot_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from oscar_export.kernels.aot import launch_plan as lp  # noqa: E402
from oscar_export.kernels.aot import trt_order  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout, PagedKV  # noqa: E402
from oscar_export.kernels.transform import LayerTransform  # noqa: E402

from helpers import ragged_cache  # noqa: E402


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_trt_order_kernels_equal_the_portable_wrapper(da, device, gran):
    lay = KVCacheLayout.default(2, 64, gran, sink=16, window=32)
    tr = LayerTransform.identity(2, 64, 0.95, 0.9)
    st = ragged_cache(lay, [5, 300], tr)
    st = PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__})
    k_levels, v_levels = tr.k_levels.to(device), tr.v_levels.to(device)
    bsz, hq, d, pps = 2, 6, 64, 1
    q = torch.randn(bsz, hq, d, device=device)  # [B, H, D], the stored key basis
    want = da.decode_attention(q, st, lay, k_levels, v_levels, 0.125, pages_per_split=pps, fast_unpack=False)

    split, merge = lp.TRT_DECODE_SPLIT, lp.TRT_DECODE_MERGE
    cx = lp.decode_split_constexprs(lay, hq, 0.125, fast_unpack=False)
    scalars = split.scalars({"max_pages": st.block_table.shape[1], "pages_per_split": pps}, cx)
    n_splits = scalars["n_splits"]
    assert scalars["n_page_splits"] > 2, "several page splits (and a count unlike pages_per_split)"
    part_o = torch.empty(bsz, hq, n_splits, d, device=device)
    part_lse = torch.empty(bsz, hq, n_splits, device=device)
    out = torch.empty(bsz, hq, d, device=device)
    named = {f"{f}_ptr": getattr(st, f) for f in st.__dataclass_fields__}
    named.update(q_ptr=q, k_levels_ptr=k_levels, v_levels_ptr=v_levels, part_o_ptr=part_o, part_lse_ptr=part_lse,
                 out_ptr=out, **scalars)
    trt_order._decode_split_trt_kernel[split.grid_for({"B": bsz, **scalars}, cx)](
        *(named[p] for p in split.param_names), **cx, num_warps=split.num_warps, num_stages=split.num_stages)
    mcx = lp.decode_merge_constexprs(d)
    trt_order._merge_trt_kernel[merge.grid_for({"rows": bsz * hq}, mcx)](
        *(named[p] for p in merge.param_names), **mcx, num_warps=merge.num_warps)
    assert torch.equal(out, want), (out - want).abs().max()
