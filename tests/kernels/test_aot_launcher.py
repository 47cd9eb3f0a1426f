"""Argument packing (kernels/aot/launcher.py): what the launcher and the plugins hand ``cuLaunchKernel``.

The ``bundle`` fixture (the probe kernels' bundle) is tests/kernels/conftest.py's. Launching needs a GPU:
tests/gpu/test_aot_gpu.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

pytest.importorskip("triton")

from oscar_export.kernels.aot.launcher import pack_arguments, scalar_values  # noqa: E402
from oscar_export.kernels.aot.manifest import read_manifest  # noqa: E402


def test_pack_arguments_layout(bundle):
    e = read_manifest(bundle).entry("probe_dequant_rows_d64_g64", "sm_90")
    packed = pack_arguments(e, [0x1000, 0x2000, 0x3000, 77])
    assert len(packed.array) == 4 + 2
    ptrs = [ctypes.c_void_p.from_address(a).value for a in packed.array[:3]]
    assert ptrs == [0x1000, 0x2000, 0x3000]
    assert ctypes.c_int32.from_address(packed.array[3]).value == 77
    assert [ctypes.c_void_p.from_address(a).value for a in packed.array[4:]] == [None, None]  # hidden NULLs
    assert scalar_values(e, [0x1000, 0x2000, 0x3000, 77]) == {"rows": 77}
    byname = pack_arguments(e, {"packed_ptr": 16, "params_ptr": 32, "out_ptr": 48, "rows": 5})
    assert ctypes.c_int32.from_address(byname.array[3]).value == 5
    assert e.param_bytes() == [8, 8, 8, 4, 8, 8]


@pytest.mark.parametrize(
    "args, err, match",
    [
        ([16, 32, 48], TypeError, "expected 4 arguments"),
        ([17, 32, 48, 1], ValueError, "not 16-byte aligned"),
        ([16, 32, 48, 2**31], ValueError, "does not fit in int32"),
        ([16, 32, 48, 1.0], TypeError, "expected an int"),
        ([True, 32, 48, 1], TypeError, "got bool"),
        (["x", 32, 48, 1], TypeError, "CUDA tensor or device address"),
        ([torch.zeros(4, dtype=torch.uint8), 32, 48, 1], ValueError, "expected a CUDA tensor"),
        ({"packed_ptr": 16}, TypeError, "missing arguments"),
    ],
)
def test_pack_arguments_rejects_bad_input(bundle, args, err, match):
    e = read_manifest(bundle).entry("probe_dequant_rows_d64_g64", "sm_90")
    with pytest.raises(err, match=match):
        pack_arguments(e, args)
