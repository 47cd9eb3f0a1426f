"""Shared fixtures and the boundary-heavy shape grid (DESIGN §8, STYLE "tests that can fail")."""

from __future__ import annotations

import pytest
import torch

#: lengths around the windows for the default S0=64, W=256, P=64: 1, S0-1, S0, S0+1, S0+W, S0+W+1,
#: S0+W+P (last length without pages), +1 (first page), page edges and odd lengths.
BOUNDARY_LENGTHS = [1, 63, 64, 65, 320, 321, 384, 385, 448, 449, 511, 777]
#: (query heads, KV heads): GQA ratios 1, 3, 4, 8.
GQA_SHAPES = [(3, 3), (9, 3), (8, 2), (16, 2)]
HEAD_DIMS = [64, 128]


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
