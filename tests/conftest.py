"""Shared fixtures (the boundary-heavy shape grid is in ``helpers.py``: a name every test file imports alike), among
them the Triton kernel modules two test folders launch (tests/kernels, tests/plugins; ``helpers.kernel_module``)."""

from __future__ import annotations

import pytest
import torch

from helpers import kernel_fixture


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded once per test session."""
    pytest.importorskip("gguf")
    from oscar_export.models import cached_default_model

    try:
        return cached_default_model()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: CUDA when present, else the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


qp = kernel_fixture("quant_pack")
ds = kernel_fixture("decode_step")


def pytest_configure(config):
    # the README's test command selects `not slow or representative`: a test marked `slow` runs in CI too when it
    # is also marked `representative` (one per part of the pipeline, chosen for what only it checks); the rest
    # of the slow tests run by hand (`pytest -m slow`)
    config.addinivalue_line("markers", "representative: a slow test CI runs anyway (see the README's test command)")
