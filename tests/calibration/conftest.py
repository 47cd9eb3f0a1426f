"""Fixtures of the calibration tests (``art_dir`` is defined once, in ``helpers.py``)."""

from __future__ import annotations

import pytest

from helpers import (
    art_dir,  # noqa: F401 - a fixture, found by pytest in this module's names
    capture_llama,
)


@pytest.fixture(scope="module")
def tiny():
    """:func:`helpers.capture_llama`, built once per test module (the capture and covariance tests;
    test_pipeline.py has a ``tiny`` model of its own)."""
    return capture_llama()
