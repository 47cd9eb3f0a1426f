"""The row format and cache layout: validation of the page packing field (docs/design.md §3.1, §3.2)."""

from __future__ import annotations

import pytest

from oscar_export.kernels.layout import PACKINGS, KVCacheLayout, RowFormat


def test_packing_default_and_serialisation():
    fmt = RowFormat.default(128)
    assert fmt.packing == "linear" and PACKINGS == ("linear", "mma16")
    lay = KVCacheLayout.default(8, 128, packing="mma16")
    assert lay.key.packing == lay.value.packing == lay.packing == "mma16"
    assert KVCacheLayout.from_dict(lay.to_dict()) == lay
    old = KVCacheLayout.default(8, 128).to_dict()
    del old["key"]["packing"], old["value"]["packing"]
    assert KVCacheLayout.from_dict(old) == KVCacheLayout.default(8, 128)
    assert KVCacheLayout.default(8, 128).matches_dict(old) and not lay.matches_dict(old)
    assert not lay.matches_dict({"bogus": 1})


def test_packing_validation():
    with pytest.raises(ValueError, match=r"RowFormat.packing: unknown packing 'zigzag'; this version knows"):
        RowFormat(64, 64, packing="zigzag")
    with pytest.raises(ValueError, match="'mma16': head_dim must be a multiple of 32, got 48"):
        RowFormat(48, 48, packing="mma16")
    with pytest.raises(ValueError, match="values packed 'mma16' need a multiple of 32, got 16"):
        KVCacheLayout.default(2, 64, page_size=16, packing="mma16")
    # keys alone in mma16 only need P % 16
    k = RowFormat(64, 64, packing="mma16")
    lay = KVCacheLayout(2, 64, key=k, value=RowFormat(64, 64), page_size=16)
    assert lay.packing == "mixed"
