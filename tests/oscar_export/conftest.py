"""Fixtures of the command-line and output tests."""

from __future__ import annotations

import pytest

from helpers import random_artifact, tiny_model


@pytest.fixture
def art_dir(tmp_path):
    """A random artifact of :func:`helpers.tiny_model`, saved to ``tmp_path / "art"``."""
    d = tmp_path / "art"
    random_artifact(tiny_model()).save(d)
    return d
