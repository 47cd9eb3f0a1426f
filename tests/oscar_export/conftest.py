"""Fixtures of the command-line and output tests (``art_dir`` is defined once, in ``helpers.py``)."""

from __future__ import annotations

from helpers import art_dir  # noqa: F401 - a fixture, found by pytest in this module's names
