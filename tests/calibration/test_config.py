"""``calibration/config.py``: ``CalibrationConfig`` refuses invalid options, each error naming the field; the window the
objective honours."""

from __future__ import annotations

import pytest

from helpers import small_cfg


def test_config_validation():
    with pytest.raises(ValueError, match="rotation: expected one of"):
        small_cfg(rotation="svd")
    with pytest.raises(ValueError, match="clip: expected one of"):
        small_cfg(clip="auto")
    with pytest.raises(ValueError, match="seq_len: expected >= sink \\+ page_size = 32, got 24"):
        small_cfg(seq_len=24)
    with pytest.raises(ValueError, match="need more than the 2 held-out ones"):
        small_cfg(tokens=2 * 96)
    with pytest.raises(ValueError, match="scale='whiten' needs a fixed rotation"):
        small_cfg(scale="whiten")
    with pytest.raises(ValueError, match="value_weighting: expected one of"):
        small_cfg(value_weighting="softmax")
    assert small_cfg().objective_window == 32 and small_cfg(seq_len=48).objective_window == 0


def test_key_bits_config_validation():
    with pytest.raises(ValueError, match="key_bits_metric: expected one of"):
        small_cfg(key_bits_metric="mse")
    for bad in (0.0, -1.0, float("inf"), True, "3"):
        with pytest.raises(ValueError, match="key_bits_budget: expected None or bits per element > 0"):
            small_cfg(key_bits_budget=bad)
    with pytest.raises(ValueError, match=r"read no page unless seq_len > sink \+ window \+ page_size = 64, got 64"):
        small_cfg(seq_len=64, key_bits_budget=3.0)


def test_mma16_pages_take_the_4_bit_key_layers():
    """A key-bit budget (4-bit keys in some layers) calibrates for mma16 pages as for linear ones: the hopper decode
    kernel reads 4-bit key pages (``kernels/checks.py``), so the configuration refuses neither."""
    from oscar_export.kernels.checks import check_hopper_layout

    cfg = small_cfg(packing="mma16", key_bits_budget=3.0, page_size=64, seq_len=192, tokens=8 * 192)
    for layer in cfg.layout(2, 64).per_layer((2, 4)):
        check_hopper_layout(layer, num_heads=8)
