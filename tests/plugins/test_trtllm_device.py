"""plugins/trtllm/device.py on the CPU: every AOT launch names exactly the launch plan's parameters, with the
dtypes of its pointer types and the plan's launch sizes. (The launches themselves run on an H200 in
tests/gpu/test_trtllm_gpu.py and tests/gpu/test_aot_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.aot import launch_plan as lp
from oscar_export.kernels.aot.launcher import TORCH_DTYPES
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.trtllm.device import AotCacheOps

LAYOUT = KVCacheLayout.default(2, 64, sink=16, window=16, page_size=16)


class _Kernel:
    def __init__(self, plan):
        self.plan, self.calls = plan, []

    def launch(self, *args, named=None, grid_inputs=None):
        assert not args and named is not None, f"{self.plan.name}: launched positionally"
        assert list(named) == self.plan.param_names or set(named) == set(self.plan.param_names), (
            f"{self.plan.name}: named {sorted(named)} != plan {sorted(self.plan.param_names)}")
        for name, typ in self.plan.params:
            v = named[name]
            if typ.startswith("*") and isinstance(v, torch.Tensor):
                assert str(v.dtype).removeprefix("torch.") == TORCH_DTYPES[typ], f"{self.plan.name}.{name}: {v.dtype}"
            elif not typ.startswith("*"):
                assert isinstance(v, int), f"{self.plan.name}.{name}: {type(v).__name__}"
        assert set(grid_inputs) == set(self.plan.sizes), f"{self.plan.name}: grid inputs {grid_inputs}"
        self.calls.append(named)


def _ops():
    ops = AotCacheOps.__new__(AotCacheOps)  # no bundle, no GPU: recording kernels
    ops.layout, ops.num_heads = LAYOUT, 4
    ops.quant_k, ops.quant_v = _Kernel(lp.QUANT_PACK), _Kernel(lp.QUANT_PACK)
    ops.split, ops.merge = _Kernel(lp.DECODE_SPLIT), _Kernel(lp.DECODE_MERGE)
    ops._append = _Kernel(lp.DECODE_APPEND)
    return ops


def test_every_device_launch_is_the_launch_plan():
    ops = _ops()
    st = PagedKV.allocate(LAYOUT, 3, 8, 4, dtype=torch.bfloat16)
    t = LayerTransform.identity(2, 64)
    k = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    q_s = ops.decode_step(st, k, k, torch.zeros(3, dtype=torch.int32), t, q)
    ops.decode(q_s, st, t, 2)
    rows = torch.zeros(2, 70, 64, dtype=torch.bfloat16)  # 70 tokens: sink 16, 2 pages, recent 22
    st.block_table[0, :2] = torch.tensor([5, 2], dtype=torch.int32)
    ops.write(st, 0, 0, rows, rows, t)
    assert ops.quant_k.calls[0]["page_ids_ptr"].tolist() == [5, 2]
    for kern in (ops.append_kernel, ops.split, ops.merge, ops.quant_k, ops.quant_v):
        assert kern.calls, f"{kern.plan.name} was not launched"
    assert ops.split.calls[0]["n_splits"] == ops.merge.calls[0]["n_splits"]


def test_the_step_rotates_the_queries_once_and_decode_reads_them():
    """On the TensorRT-LLM path the decode step's one append launch takes the step's model-basis
    queries and writes their stored-basis rotation into an fp32 ``[B, H, D]`` tensor it returns; the split kernel is
    launched on that tensor."""
    ops = _ops()
    st = PagedKV.allocate(LAYOUT, 3, 8, 4, dtype=torch.bfloat16)
    t = LayerTransform.identity(2, 64)
    k = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    q = torch.randn(3, 4, 64).bfloat16()
    q_s = ops.decode_step(st, k, k, torch.zeros(3, dtype=torch.int32), t, q)
    (call,) = ops.append_kernel.calls
    assert call["q_ptr"] is q and call["q_rot_ptr"] is q_s
    assert q_s.shape == (3, 4, 64) and q_s.dtype == torch.float32 and q_s.is_contiguous()
    ops.decode(q_s, st, t, 2)
    assert ops.split.calls[0]["q_ptr"] is q_s


def test_a_bundle_built_before_the_step_rotated_the_queries_is_refused():
    """Older bundles rotate in every split program (BF16 model-basis ``q``) and their append launch writes no
    queries: ``AotCacheOps`` refuses them when it loads them instead of attending with unrotated queries."""
    from dataclasses import replace

    from oscar_export.kernels.aot import bundle
    from oscar_export.kernels.aot.manifest import BundleError
    from oscar_export.kernels.aot.spec import KernelSpec
    from oscar_export.plugins.trtllm.device import check_query_rotation

    tag = bundle.layout_tag(LAYOUT, 4)
    specs = {s.name: s for s in bundle.serving_specs(LAYOUT, 4, 0.125, probes=False)}
    for name in ("decode_split", "decode_append"):
        check_query_rotation(specs[f"{name}_{tag}"])
    old_append = KernelSpec.from_plan(lp.DECODE_APPEND, "decode_append_old", lp.decode_append_constexprs(LAYOUT))
    with pytest.raises(BundleError, match=r"decode_append_old: built without the step's query rotation"):
        check_query_rotation(old_append)
    split = specs[f"decode_split_{tag}"]
    old_split = replace(split, name="decode_split_old",
                        params=tuple(replace(p, type="*bf16") if p.name == "q_ptr" else p for p in split.params))
    with pytest.raises(BundleError, match=r"decode_split_old: built without fp32 stored-basis queries"):
        check_query_rotation(old_split)
