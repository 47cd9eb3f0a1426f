"""The hopper decode backend's wrapper (kernels/decode/hopper.py) on the CPU: the fused merge's counters and the
launch's choice of kernel (the launch stubbed). The kernel itself: test_decode_hopper_kernel.py; on a GPU
tests/gpu/test_kernels_gpu.py -k gluon.
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.decode import hopper_kernel as gl_attn

from helpers import hopper_wrapper


def test_fused_merge_counters_are_allocated_once_and_bounded():
    hopper = hopper_wrapper()
    with pytest.raises(ValueError, match="at most 65536"):
        hopper.merge_counters(torch.device("cpu"), hopper.MERGE_COUNTERS + 1)
    buf = hopper.merge_counters(torch.device("cpu"), 4)
    assert buf.dtype == torch.int32 and buf.numel() == hopper.MERGE_COUNTERS and not buf.any()
    assert hopper.merge_counters(torch.device("cpu"), 8) is buf, "allocated once: captured graphs keep its address"


@pytest.mark.parametrize("key_bits", [2, 4])
def test_fused_merge_is_the_plans_default_up_to_the_counters(monkeypatch, key_bits):
    """The launch takes the fused kernel with the shared counters by default, and the launched merge beyond
    MERGE_COUNTERS (sequence, KV head) pairs (no error at a large batch); ``KEY_BITS`` follows the key pool's row
    bytes. The launch is stubbed (CPU), the decisions are the wrapper's."""
    hopper = hopper_wrapper()
    seen = []
    monkeypatch.setattr(hopper, "launch_split_merge",
                        lambda kernel, *a, counters=None: seen.append((kernel, counters, a[-3]["KEY_BITS"])))
    t = torch.zeros(1)
    k_codes = torch.zeros(1, 8, 64, 64 * key_bits // 8, dtype=torch.uint8)

    def launch(batch, **kw):
        q = torch.zeros(batch, 8, 64)
        hopper.launch(q, t, t, t, t, k_codes, *[t] * 9, num_kv_heads=8, page_size=64, sink=64, recent_slots=384,
                      scale=0.125, k_channel=False, pages_per_split_=4, out_dtype=torch.float32, **kw)
        kernel, counters, bits = seen.pop()
        assert bits == key_bits
        return kernel, counters

    kernel, counters = launch(2)
    assert kernel is gl_attn.FUSED_KERNEL and counters is hopper.merge_counters(torch.device("cpu"), 16)
    kernel, counters = launch(hopper.MERGE_COUNTERS // 8 + 1)
    assert kernel is gl_attn.KERNEL and counters is None
    assert launch(2, fused_merge=False) == (gl_attn.KERNEL, None)
    with pytest.raises(ValueError, match="at most 65536"):
        launch(hopper.MERGE_COUNTERS // 8 + 1, fused_merge=True)
