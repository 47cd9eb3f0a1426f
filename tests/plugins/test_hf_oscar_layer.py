"""One OSCAR cache layer (plugins/hf/oscar_layer.py): its transform's identity flags, its transform and paged state
as the layer keeps them (the cache's steps through its layers: test_hf_cache.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf.oscar_layer import TransformFlags

from helpers import one_layer, rotated_transform, small_layout


def test_transform_flags_say_which_parts_are_the_identity():
    assert TransformFlags.of(LayerTransform.identity(2, 32)) == TransformFlags(True, True, True)
    rotated = rotated_transform(2, 32, seed=1)
    assert TransformFlags.of(rotated) == TransformFlags(False, False, False)
    assert TransformFlags.of(replace(rotated, values_prerotated=True)) == TransformFlags(False, True, False)
    centered = replace(LayerTransform.identity(2, 32), k_mean=torch.full((2, 32), 0.5))
    assert TransformFlags.of(centered) == TransformFlags(False, True, True)


def test_layer_keeps_a_contiguous_transform_and_two_views_of_one_state():
    """The transform the layer keeps is contiguous (a transposed rotation given) and its flags are the transform's;
    ``state`` (committed lengths) and ``step_state`` (the step in flight) are views of the same buffers."""
    tr = rotated_transform(2, 32, seed=2)
    tr = replace(tr, k_rotation=tr.k_rotation.transpose(1, 2).contiguous().transpose(1, 2))
    assert not tr.k_rotation.is_contiguous()
    _, layer = one_layer(small_layout(), tr, 2, 64)
    assert layer.transform.k_rotation.is_contiguous() and torch.equal(layer.transform.k_rotation, tr.k_rotation)
    assert layer.flags == TransformFlags.of(tr)
    assert layer.state.k_codes.data_ptr() == layer.step_state.k_codes.data_ptr()
    assert layer.state.num_pages.data_ptr() != layer.step_state.num_pages.data_ptr()
