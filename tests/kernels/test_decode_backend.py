"""``select_backend`` (kernels/decode/backend.py): which decode kernel reads a layer's pages on a device, and so
in which packing its pages are written.

The refusals of each backend's layout check: test_checks.py.
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import checks
from oscar_export.kernels.layout import KVCacheLayout, RowFormat

from helpers import hopper_wrapper, mma_layout


def test_head_dim_256_with_two_groups_a_row_selects_the_hopper_kernel():
    """Gemma 3's default (head_dim 256, token groups of 128) decodes on the hopper kernel on sm_90: its two-group
    path passed on the H200 (tests/gpu/test_kernels_gpu.py::test_decode_attention_gluon_two_groups_head_dim_256,
    on the H200); groups of 64 at head_dim 256 still go to the portable kernel."""
    from oscar_export.kernels.decode import select_backend

    hopper_wrapper()
    for gran in ("token", "channel"):
        for bits in (2, 4):
            lay = KVCacheLayout.default(8, 256, gran).with_key_bits(bits)
            assert lay.value.group_size == 128
            checks.check_hopper_layout(lay.with_packing("mma16"), 16)
            got = select_backend(lay, 90, 16)
            assert (got.name, got.why) == ("hopper", ""), (gran, bits, got)
    narrow = KVCacheLayout(8, 256, RowFormat(256, 64), RowFormat(256, 64), sink=64, window=256, page_size=128)
    got = select_backend(narrow, 90, 16)
    assert got.name == "portable" and "128" in got.why, got


def test_select_backend_table(monkeypatch):
    """``select_backend``: Hopper -> the Gluon kernel on mma16 pages for the formats it reads, another GPU or a
    format it does not read -> the portable kernel on linear pages, the CPU -> the reference; by sm arch too (what
    a bundle built without a GPU asks)."""
    pytest.importorskip("triton")
    from oscar_export.kernels.decode import hopper, select_backend

    lay = KVCacheLayout.default(2, 64, "channel")
    assert select_backend(lay, "cpu", 4).name == "reference"
    assert select_backend(lay, 80, 4).name == "portable" and "sm_80" in select_backend(lay, 80, 4).why
    if not hopper.HAVE_GLUON:
        assert select_backend(lay, 90, 4).name == "portable"
        return
    assert select_backend(lay, 90, 4).name == "hopper"
    assert select_backend(lay, 90, 4).layout(lay).packing == "mma16"
    assert select_backend(mma_layout(codebook=True), 90, 4).name == "portable"  # fitted levels: not in the Gluon kernel
    assert select_backend(lay, 90, 18).name == "portable"  # GQA 9
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert select_backend(lay, torch.device("cuda"), 4).name == "portable"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert select_backend(lay, torch.device("cuda"), 4).name == "hopper"


def test_backends_by_width_is_select_backend_of_each_width():
    """One backend per distinct key width, each ``select_backend`` of the base layout with that width in linear
    packing: what the HF cache and the AOT bundle both read."""
    pytest.importorskip("triton")
    from oscar_export.kernels.decode import select_backend
    from oscar_export.kernels.decode.backend import backends_by_width

    lay = KVCacheLayout.default(2, 64, "channel").with_packing("mma16")
    for device in ("cpu", 80, 90):
        got = backends_by_width(lay, (4, 2, 4, 2, 2), device, 4)
        assert sorted(got) == [2, 4]
        for bits, backend in got.items():
            assert backend == select_backend(lay.with_packing("linear").with_key_bits(bits), device, 4)
    assert backends_by_width(lay, (), 90, 4) == {}
