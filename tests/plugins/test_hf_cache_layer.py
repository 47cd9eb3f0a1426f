"""``plugins/hf/cache_layer.py``: ``update`` checks the new tokens before anything is written, and a step that
reaches attention that is not OSCAR's fails with one clear error."""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf import cache_kwargs, enable_oscar

from helpers import SMALL_LAYOUT, one_layer, small_layout, tiny_hf_model


@pytest.mark.parametrize(
    "k_shape, dtype, match",
    [
        ((2, 2, 1, 32), torch.float32,
         r"key_states: expected \[1, 2, T, 32\], got \[2, 2, 1, 32\] \(batch = the cache's active slots\)"),
        ((1, 3, 1, 32), torch.float32, r"expected \[1, 2, T, 32\].*got \[1, 3, 1, 32\]"),
        ((1, 2, 1, 16), torch.float32, r"got \[1, 2, 1, 16\]"),
        ((1, 2, 32), torch.float32, r"got \[1, 2, 32\]"),
        ((1, 2, 1, 32), torch.int64, "expected a float dtype, got torch.int64"),
    ],
)
def test_update_rejects_bad_shapes_and_dtypes(k_shape, dtype, match):
    cache, layer = one_layer(small_layout(), LayerTransform.identity(2, 32), 1, 50)
    k = torch.zeros(k_shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        layer.update(k, k)
    with pytest.raises(ValueError, match="value_states: expected"):
        layer.update(torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 2, 32))
    assert int(cache.seen) == 0


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_a_cache_used_after_restore_fails_with_one_clear_error():
    """A cache used after ``restore()`` fails with one clear error (not an AttributeError about ``LayerStep``)."""
    model = tiny_hf_model("llama")
    oscar = enable_oscar(model, layout=SMALL_LAYOUT)
    cache = oscar.make_cache(1, 64)
    oscar.restore()
    msg = r"an OscarCache reached attention that is not OSCAR's .*setup.restore\(\)"
    with pytest.raises(AttributeError, match=msg):
        with torch.no_grad():
            model(torch.randint(1, 96, (1, 8)), **cache_kwargs(model, cache))
