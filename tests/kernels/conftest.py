"""Fixtures of the Triton kernel tests: each kernel module as it runs here, compiled on a GPU, interpreted on the CPU
(``helpers.kernel_module``: without a GPU, the first test of a kernel test file runs that whole file once in a child
pytest process with ``TRITON_INTERPRET=1``), and the probe kernels' AOT bundle."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from helpers import build_probe_bundle, kernel_module


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: CUDA when present, else the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def qp(request) -> ModuleType:
    """``kernels.quant_pack`` as it runs here (see the module doc)."""
    return kernel_module(request, "quant_pack")


@pytest.fixture
def ds(request) -> ModuleType:
    """``kernels.decode_step`` as it runs here (see the module doc)."""
    return kernel_module(request, "decode_step")


@pytest.fixture
def da(request) -> ModuleType:
    """``kernels.decode.portable`` as it runs here (see the module doc)."""
    return kernel_module(request, "decode.portable")


@pytest.fixture
def ct_mod(request) -> ModuleType:
    """``kernels.clip_threshold`` as it runs here (see the module doc): its helpers in a test file's own kernel."""
    return kernel_module(request, "clip_threshold")


@pytest.fixture
def pp_mod(request) -> ModuleType:
    """``kernels.decode.portable_pages`` as it runs here (see the module doc): its helpers in a test file's kernel."""
    return kernel_module(request, "decode.portable_pages")


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    """The probe kernels' bundle (kernels/aot/probe.py) for every target, built once for the AOT tests
    (test_aot_compile.py, test_aot_manifest.py, test_aot_launcher.py); skipped without Triton."""
    pytest.importorskip("triton")
    root = tmp_path_factory.mktemp("aot")
    return build_probe_bundle(root / "bundle", root / "cache")
