"""TensorRT plugins: the plain-Python shape/argument rules; the tensorrt.plugin definitions were NOT executed
(TensorRT cannot be installed here) beyond their import guard."""

from __future__ import annotations

import importlib.util
import re

import pytest

from oscar_export.kernels.aot.bundle import decode_plan, layout_tag, trt_specs
from oscar_export.kernels.aot.launch_plan import tensor_name
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.plugins.trt import DecodeShapes, check_split_inputs
from oscar_export.plugins.trt.shapes import SPLIT_EXTRAS, SPLIT_INPUTS, SPLIT_OUTPUTS

LAYOUT = KVCacheLayout.default(3, 64)
#: the split plugin's inputs for LAYOUT (token keys), batch 2, a pool of 7 pages, a block table of 5 pages a slot
LAYOUT_DIMS = {
    "q_s": (2, 9, 64), "sink_k": (2, 3, 64, 64), "sink_v": (2, 3, 64, 64), "recent_k": (2, 3, 384, 64),
    "recent_v": (2, 3, 384, 64), "k_codes": (7, 3, 64, 16), "k_params": (7, 3, 64, 1, 2), "v_codes": (7, 3, 64, 16),
    "v_params": (7, 3, 64, 1, 2), "k_levels": (3, 4), "v_levels": (3, 4), "block_table": (2, 5), "sink_len": (2,),
    "num_pages": (2,), "recent_len": (2,),
}


@pytest.mark.parametrize("batch, max_pages, pps", [(1, 1, 1), (3, 10, 4), (8, 129, 8), (2, 16, 16)])
def test_shapes_agree_with_the_decode_plan(batch, max_pages, pps):
    s = DecodeShapes.from_layout(LAYOUT, 9, pps)
    plan = decode_plan(LAYOUT, batch, 9, max_pages, pps)
    assert s.split_extras(max_pages) == (plan.max_pages, plan.pages_per_split, plan.n_page_splits, plan.n_splits)
    assert s.split_outputs(batch, max_pages) == ((batch, 9, plan.n_splits, 64), (batch, 9, plan.n_splits))
    assert s.split_grid(batch, max_pages) == (batch * 3, plan.n_splits, 1)
    assert s.merge_grid(batch) == (batch * 9, 1, 1) and s.merge_output(batch) == (batch, 9, 64)


def test_trt_kernel_parameter_order_is_inputs_extras_outputs():
    split, merge = trt_specs(LAYOUT, 9, 0.125, layout_tag(LAYOUT, 9))
    names = [p.name for p in split.params]
    assert [tensor_name(n) for n in names[: len(SPLIT_INPUTS)]] == list(SPLIT_INPUTS)
    assert SPLIT_INPUTS[0] == "q_s"  # the step's stored-basis queries (the kernel's q_ptr)
    assert len(names) == len(SPLIT_INPUTS) + len(SPLIT_EXTRAS) + len(SPLIT_OUTPUTS)
    assert names[len(SPLIT_INPUTS):len(SPLIT_INPUTS) + 4] == list(SPLIT_EXTRAS)
    assert names[-2:] == ["part_o_ptr", "part_lse_ptr"]
    assert all(p.is_pointer for p in split.params[: len(SPLIT_INPUTS)])
    assert [p.name for p in merge.params] == ["part_o_ptr", "part_lse_ptr", "n_splits", "out_ptr"]
    split.jit_function()  # the wrapper kernels' arguments match these specs
    merge.jit_function()


def test_check_split_inputs():
    s = DecodeShapes.from_layout(LAYOUT, 9, 4)
    b, hkv, d = 2, 3, 64
    dims = {
        "q_s": (b, 9, d), "sink_k": (b, hkv, 64, d),
        "sink_v": (b, hkv, 64, d), "recent_k": (b, hkv, 384, d), "recent_v": (b, hkv, 384, d),
        "k_codes": (7, hkv, 64, 16), "k_params": (7, hkv, 64, 1, 2), "v_codes": (7, hkv, 64, 16),
        "v_params": (7, hkv, 64, 1, 2), "k_levels": (hkv, 4), "v_levels": (hkv, 4), "block_table": (b, 5),
        "sink_len": (b,), "num_pages": (b,), "recent_len": (b,),
    }
    assert list(dims) == list(SPLIT_INPUTS)  # the queries (rotated once a step before the plugin) and the cache
    assert check_split_inputs(s, dims) == (2, 5)
    # the recent ring holds W + 2P = 384 slots; a W + P buffer (the pre-ring layout) is refused
    with pytest.raises(ValueError, match=r"recent_k: expected \[2, 3, 384, 64\], got \[2, 3, 320, 64\]"):
        check_split_inputs(s, {**dims, "recent_k": (b, hkv, 320, d)})
    with pytest.raises(ValueError, match=r"q_s: expected \[B, 9, 64\]"):
        check_split_inputs(s, {**dims, "q_s": (b, 8, d)})
    with pytest.raises(ValueError, match="block_table: expected"):
        check_split_inputs(s, {**dims, "block_table": (b, 0)})
    with pytest.raises(ValueError, match="missing inputs"):
        check_split_inputs(s, {"q_s": (b, 9, d)})


@pytest.mark.parametrize("name, bad, want", [
    ("k_codes", (7, 3, 64, 32), "[7, 3, 64, 16]"),         # 4-bit key codes for a 2-bit layout
    ("k_params", (7, 3, 2, 64), "[7, 3, 64, 1, 2]"),       # channel params for token keys
    ("v_codes", (7, 3, 32, 16), "[7, 3, 64, 16]"),         # another page size
    ("v_params", (7, 2, 64, 1, 2), "[7, 3, 64, 1, 2]"),    # another KV head count
    ("v_codes", (6, 3, 64, 16), "[7, 3, 64, 16]"),         # a pool of another size than k_codes'
    ("k_codes", (0, 3, 64, 16), "a pool of N > 0 pages"),  # no page
])
def test_check_split_inputs_reads_the_pool_shapes_from_the_layout(name, bad, want):
    s = DecodeShapes.from_layout(LAYOUT, 9, 4)
    dims = {n: LAYOUT_DIMS[n] for n in SPLIT_INPUTS}
    assert check_split_inputs(s, dims) == (2, 5)
    with pytest.raises(ValueError, match=re.escape(f"{name}: expected {want}")):
        check_split_inputs(s, {**dims, name: bad})


def test_channel_key_pools_are_the_layouts_too():
    lay = KVCacheLayout.default(3, 64, "channel")
    s = DecodeShapes.from_layout(lay, 9, 4)
    dims = {**LAYOUT_DIMS, "k_params": lay.key_params_shape(7)}
    assert dims["k_params"] == (7, 3, 2, 64) and check_split_inputs(s, dims) == (2, 5)
    with pytest.raises(ValueError, match=re.escape("k_params: expected [7, 3, 2, 64], got [7, 3, 64, 1, 2]")):
        check_split_inputs(s, LAYOUT_DIMS)


def test_pools_need_the_layout():
    with pytest.raises(ValueError, match="DecodeShapes.from_layout"):
        check_split_inputs(DecodeShapes(9, 3, 64, 64, 384, 4), LAYOUT_DIMS)


def test_bad_shapes_config():
    with pytest.raises(ValueError, match="not a multiple"):
        DecodeShapes(8, 3, 64, 64, 384, 4)
    with pytest.raises(ValueError, match="pages_per_split"):
        DecodeShapes(9, 3, 64, 64, 384, 0)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed")
def test_import_guard(tmp_path):
    from oscar_export.plugins.trt import register_plugins

    with pytest.raises(ImportError, match="TensorRT >= 10.9"):
        register_plugins(tmp_path, LAYOUT, 9)
