"""``plugins/hf/cache_size.py``: a cache beyond the int32 bounds or the free memory refused before allocation."""

from __future__ import annotations

import time

import pytest

from oscar_export.plugins.hf import enable_oscar

from helpers import SMALL_LAYOUT, tiny_hf_model


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_sizes_are_bounded_before_allocation():
    """make_cache of 1e6 slots is refused before anything is allocated."""
    model = tiny_hf_model("llama")
    with enable_oscar(model, layout=SMALL_LAYOUT) as oscar:
        t0 = time.perf_counter()
        with pytest.raises(MemoryError, match=r"an OscarCache of 1,000,000 slots x 1,000,000 tokens needs about"):
            oscar.make_cache(10**6, 10**6)
        with pytest.raises(ValueError, match="expected at most 1,048,576 slots"):
            oscar.make_cache(1 << 21, 16)
        assert time.perf_counter() - t0 < 1
