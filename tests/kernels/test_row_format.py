"""The row format (kernels/row_format.py, docs/design.md §3.1) by itself: the ``PACKING`` constexpr each pool's pages
get and the default group size. The row format inside a cache layout (serialisation, validation, 4-bit keys, byte
counts) is tested with the layout, tests/kernels/test_layout.py."""

from __future__ import annotations

import pytest

from oscar_export.kernels.row_format import (
    PACK_LINEAR,
    PACK_MMA16_KEY,
    PACK_MMA16_VALUE,
    RowFormat,
    default_group_size,
    packing_code,
)


def test_packing_code_per_pool():
    """Linear pages are one order for both pools; mma16 pages are ordered as their MMA operand (keys ``[P, D]``,
    values ``[D, P]``); any other operand is refused."""
    lin, mma = RowFormat(64, 64), RowFormat(64, 64, packing="mma16")
    assert packing_code(lin, "key") == packing_code(lin, "value") == PACK_LINEAR
    assert (packing_code(mma, "key"), packing_code(mma, "value")) == (PACK_MMA16_KEY, PACK_MMA16_VALUE)
    assert len({PACK_LINEAR, PACK_MMA16_KEY, PACK_MMA16_VALUE}) == 3
    with pytest.raises(ValueError, match="operand: expected 'key' or 'value', got 'query'"):
        packing_code(lin, "query")


def test_default_group_size_is_the_row_up_to_128():
    assert [default_group_size(d) for d in (64, 128, 256)] == [64, 128, 128]
    assert RowFormat.default(256).groups == 2
