"""The Triton kernels as PyTorch custom ops (kernels/triton_ops.py): ``oscar::decode_attention`` launches the same
kernels as the wrapper, bitwise. On the CPU through Triton's interpreter (tests/kernels/conftest.py). What the
ops launch against the launch plan: test_aot_launch_plan.py; the HF "triton" backend over them:
tests/plugins/test_hf_triton_backend.py."""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform

from helpers import ragged_cache


@pytest.mark.parametrize("bits", [2, 4])
def test_custom_op_matches_wrapper(da, device, bits):
    """``oscar::decode_attention`` (a torch.library custom op) launches the same kernels: bitwise equal."""
    from oscar_export.kernels import triton_ops
    from oscar_export.plugins.hf.ops import get_ops

    lay = KVCacheLayout.default(2, 64, "channel", sink=16, window=32).with_key_bits(bits)
    tr = LayerTransform.identity(2, 64, 0.95, 0.9)
    st = ragged_cache(lay, [7, 300], tr)
    dev_st = PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__})
    q = torch.randn(2, 8, 64, device=device)
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    want = da.decode_attention(q, dev_st, lay, *lv, 0.125)
    got = triton_ops.decode_attention(q, dev_st, lay, *lv, 0.125)
    assert torch.equal(got, want)
    from types import SimpleNamespace

    from oscar_export.plugins.hf.cache import TransformFlags

    trd = tr.to(device)
    layer = SimpleNamespace(layout=lay, transform=trd, flags=TransformFlags.of(trd))
    assert torch.equal(get_ops("triton").decode_attention(layer, q, dev_st, 0.125), want)
