"""The probe kernels (kernels/aot/probe.py) compute what the reference computes, under Triton's interpreter.

Their compiled bundle is the ``bundle`` fixture of tests/kernels/conftest.py (test_aot_compile.py, test_aot_manifest.py,
test_aot_launcher.py); running the binaries needs a GPU: tests/gpu/test_aot_gpu.py.
"""

from __future__ import annotations

import os

_PROBE_CHECK = """
import torch
from oscar_export.kernels import reference
from oscar_export.kernels.aot.probe import _dequant_rows_kernel, _pack_codes_kernel
rows = 37
codes = torch.randint(0, 4, (rows, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
out = torch.empty(rows, 16, dtype=torch.uint8)
_pack_codes_kernel[(3,)](codes, out, rows, D=64, G=64, BLOCK_R=16)
assert torch.equal(out, reference.pack_codes(codes, 64)), "pack differs from reference"
params = torch.randn(rows, 1, 2, generator=torch.Generator().manual_seed(1)).half()
deq = torch.empty(rows, 64)
_dequant_rows_kernel[(3,)](out, params, deq, rows, D=64, G=64, BLOCK_R=16)
ref = reference.dequantize_groups(codes, params[:, 0, 0], params[:, 0, 1], torch.tensor([0.0, 1, 2, 3]))
err = (deq - ref).abs().max().item()
assert err <= 1e-6 * ref.abs().max().item(), err
print("probe ok", err)
"""


def test_probe_kernels_match_reference_under_the_interpreter():
    """The probe kernels compute what the reference computes (Triton's CPU interpreter, in a child process:
    the interpreter mode is fixed when Triton is imported). The GPU test checks the compiled binaries."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _PROBE_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "probe ok" in proc.stdout, proc.stdout + proc.stderr
