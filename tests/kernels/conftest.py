"""Fixtures of the Triton kernel tests: each kernel module as it runs here, compiled on a GPU, interpreted on the CPU
(``helpers.kernel_module``: without a GPU, the first test of a kernel test file runs that whole file once in a child
pytest process with ``TRITON_INTERPRET=1``; ``device``, ``qp`` and ``ds`` are tests/conftest.py's), and the probe
kernels' AOT bundle."""

from __future__ import annotations

import pytest

from helpers import build_probe_bundle, kernel_fixture

da = kernel_fixture("decode.portable")
ct_mod = kernel_fixture("clip_threshold", ": its helpers in a test file's own kernel")
pp_mod = kernel_fixture("decode.portable_pages", ": its helpers in a test file's kernel")
splits_mod = kernel_fixture("decode.splits")


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    """The probe kernels' bundle (kernels/aot/probe.py) for every target, built once for the AOT tests
    (test_aot_compile.py, test_aot_manifest.py, test_aot_launcher.py); skipped without Triton."""
    pytest.importorskip("triton")
    root = tmp_path_factory.mktemp("aot")
    return build_probe_bundle(root / "bundle", root / "cache")
