"""The cache ops table (plugins/hf/ops.py): ``get_ops`` by backend name."""

from __future__ import annotations

import pytest


def test_triton_backend_is_registered():
    pytest.importorskip("triton")
    from oscar_export.plugins.hf import get_ops

    ops = get_ops("triton")
    assert ops.name == "triton" and ops.decode_attention.__module__.endswith("triton_backend")
