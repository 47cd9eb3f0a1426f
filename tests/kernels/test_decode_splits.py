"""``kernels/decode/splits.py``: the merge of a decode attention's split partials by their log2-sum-exp, and the
GPU size the split counts read. The merge runs through Triton's interpreter on the CPU (``helpers.kernel_module``);
the launch of split + merge is checked with each backend's tests (test_decode_portable.py, test_decode_hopper.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_merge_kernel_combines_the_splits_by_log_sum_exp(splits_mod, device):
    """Each query head's output is ``Σ_s 2^(lse_s - max) o_s / Σ_s 2^(lse_s - max)`` over its splits (an empty split,
    ``lse = -inf``, weighs 0); a head whose splits are all empty gets zeros, as the reference's."""
    from oscar_export.kernels.aot import launch_plan as lp

    rows, n_splits, d = 6, 19, 64  # more splits than one merge step (MERGE_CHUNK) takes
    part_o = torch.randn(rows, n_splits, d)
    part_lse = torch.randn(rows, n_splits) * 4
    part_lse[1, 3] = float("-inf")
    part_lse[4] = float("-inf")
    w = torch.exp2(part_lse - part_lse.amax(1, keepdim=True).nan_to_num(neginf=0.0))
    want = (w[:, :, None] * part_o).sum(1) / w.sum(1, keepdim=True)
    want[4] = 0.0
    out = torch.full((rows, d), float("nan"), device=device)
    merge = lp.DECODE_MERGE
    splits_mod.merge_kernel[merge.grid_for({"rows": rows}, {})](
        part_o.to(device), part_lse.to(device), out, n_splits, **lp.decode_merge_constexprs(d),
        num_warps=merge.num_warps)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)


def test_sm_count_off_the_gpu_is_the_h200s():
    """Off a CUDA device the split counts are sized for 132 SMs (the H100 / H200's)."""
    from oscar_export.kernels.decode.splits import sm_count

    assert sm_count(torch.device("cpu")) == 132
