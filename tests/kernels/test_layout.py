"""The row format and cache layout (kernels/layout.py, docs/design.md §3.1, §3.2): serialisation, the split of a
length, the byte counts of the worked example, validation (the page packing field, 4-bit keys)."""

from __future__ import annotations

import json

import pytest

from oscar_export.kernels.layout import PACKINGS, KVCacheLayout, RowFormat

from helpers import BOUNDARY_LENGTHS


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


def test_layout_dict_round_trip():
    for lay in (KVCacheLayout.default(3, 64), KVCacheLayout.default(8, 128, "channel", sink=32, window=128)):
        d = json.loads(json.dumps(lay.to_dict()))
        assert KVCacheLayout.from_dict(d) == lay
        assert RowFormat.from_dict(lay.key.to_dict()) == lay.key


def test_split_examples_and_invariants():
    lay = KVCacheLayout.default(3, 64)
    assert lay.split(1000) == (64, 10, 296)  # the worked example of the layout docstring
    expected = {0: (0, 0, 0), 1: (1, 0, 0), 63: (63, 0, 0), 64: (64, 0, 0), 65: (64, 0, 1), 320: (64, 0, 256),
                321: (64, 0, 257), 384: (64, 0, 320), 385: (64, 1, 257), 448: (64, 1, 320), 449: (64, 2, 257)}
    for n, want in expected.items():
        assert lay.split(n) == want, n
    for n in BOUNDARY_LENGTHS + list(range(0, 700, 7)):
        s, p, r = lay.split(n)
        assert s + p * lay.page_size + r == n and r <= lay.recent_capacity
        assert p == 0 or r >= lay.window + 1
    with pytest.raises(ValueError, match="length: expected >= 0, got -1"):
        lay.split(-1)


def test_bytes_match_the_worked_example():
    lay = KVCacheLayout.default(3, 64)
    assert lay.bf16_token_bytes() == 768
    assert lay.page_bytes() == 3 * 64 * (16 + 4 + 16 + 4)
    assert lay.sequence_bytes(1000) == 276_480 + 76_800 == 353_280  # (64 + 296) BF16 tokens + 10 pages
    assert lay.int2_bits_per_element() == 2.5  # G = 64: 2 bits + fp16 (scale, lo) per 64 elements
    assert lay.effective_bits_per_element(1000) == 8 * 353_280 / (1000 * 2 * 3 * 64)


def test_layout_rejects_bad_values():
    with pytest.raises(ValueError, match="group_size"):
        RowFormat(64, 24)
    with pytest.raises(NotImplementedError, match=r"\[2, 4\] are implemented, got 3"):
        RowFormat(64, 64, bits=3)
    with pytest.raises(ValueError, match="page_size"):
        KVCacheLayout.default(3, 64, page_size=40)
    with pytest.raises(NotImplementedError, match="values"):
        KVCacheLayout(3, 64, RowFormat(64, 64), RowFormat(64, 64, "channel"))


def test_per_layer_layouts_follow_the_key_bits():
    base = KVCacheLayout.default(3, 64, "channel", packing="mma16")
    layers = base.per_layer((2, 4, 2))
    assert [lay.key.bits for lay in layers] == [2, 4, 2] and layers[0] is base and layers[1] == base.with_key_bits(4)
    assert all(lay.value == base.value and lay.key.packing == "mma16" for lay in layers)
    assert base.per_layer(()) == ()
    with pytest.raises(NotImplementedError):
        base.per_layer((2, 3))


def test_four_bit_row_format_bytes_and_refusals():
    lay = KVCacheLayout.default(3, 64, "channel").with_key_bits(4)
    assert lay.key.bits == 4 and lay.value.bits == 2 and lay.key.levels == 16
    assert lay.key_codes_shape(7) == (7, 3, 64, 32) and lay.value_codes_shape(7) == (7, 3, 64, 16)
    with pytest.raises(ValueError, match="key_codes_shape"):
        lay.codes_shape(7)
    # K: 64 * 32 codes + 2 * 64 * 2 params, V: 64 * 16 + 64 * 2 * 2 bytes per head and page
    assert lay.page_bytes() == 3 * (64 * 32 + 256 + 64 * 16 + 256)
    assert lay.key.bits_per_element(64) == 4.5 and lay.int2_bits_per_element() == 3.5
    assert KVCacheLayout.from_dict(lay.to_dict()) == lay
    for bad in (dict(bits=3), dict(bits=4, codebook=True)):
        with pytest.raises(NotImplementedError):
            RowFormat(64, 64, "token", **bad)
    assert RowFormat(64, 64, "token", bits=4, packing="mma16").codes_per_byte == 2  # the Hopper kernel's 4-bit keys
