"""plugins/trt/plugin.py checked by TensorRT's own Python plugin code (tensorrt-cu13-bindings, native layer
stubbed).

Upstream's ``tensorrt.plugin`` validators run on our ``register_plugins()``; upstream's plugin classes then
answer ``get_output_data_types`` / ``get_output_shapes`` / ``get_launch_params`` through a fake expression
builder that computes on integers, and the results are compared with the launch plan. The ONNX export's
plugin nodes are fed through upstream's ``create_plugin`` attribute check and our dtype check.

The bundle here is a manifest over stand-in binaries (``fake_bundle.py``): registration reads the PTX as text
and never runs it. The real binaries are tested in tests/kernels/test_aot_bundle.py and tests/gpu/.
"""

from __future__ import annotations

import json

import pytest

from oscar_export.kernels.aot import launch_plan as lp
from oscar_export.kernels.aot.bundle import layout_tag, trt_specs
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.plugins.trt.shapes import (
    MERGE_PLUGIN,
    PLUGIN_NAMESPACE,
    SPLIT_EXTRAS,
    SPLIT_INPUTS,
    SPLIT_PLUGIN,
    DecodeShapes,
    tensor_types,
)

from fake_bundle import fake_bundle
from tensorrt_stub import (
    FakeExpr,
    FakeExprBuilder,
    LaunchParamsOut,
    SymExprSetter,
    load_tensorrt_plugin,
    plugin_sources,
)

SOURCES = plugin_sources()
pytestmark = pytest.mark.skipif(SOURCES is None, reason="needs the tensorrt-cu13-bindings wheel (install.sh)")
LAYOUT = KVCacheLayout.default(3, 64)
HEADS, PPS, SCALE = 9, 4, 0.125


def _fake_bundle(root, num_warps=None):
    """The two TensorRT-order kernels over stand-in binaries (``fake_bundle.py``), optionally with other warps."""
    specs = trt_specs(LAYOUT, HEADS, SCALE, layout_tag(LAYOUT, HEADS))
    if num_warps is not None:
        specs = [type(s).from_dict({**s.to_dict(), "num_warps": num_warps}) for s in specs]
    return fake_bundle(root, specs, archs=("sm_80",))


@pytest.fixture
def trt(monkeypatch, tmp_path):
    trt, trtp = load_tensorrt_plugin(monkeypatch, SOURCES)
    return trt, trtp, _fake_bundle(tmp_path / "bundle")


def _dtype(trt, triton_type):
    from oscar_export.plugins.trt.plugin import TRT_DTYPES

    return getattr(trt, TRT_DTYPES[triton_type])


def _create(trt, name, fields=()):
    creator = trt.get_plugin_registry().get_creator(name, "1", PLUGIN_NAMESPACE)
    assert creator is not None, f"{PLUGIN_NAMESPACE}::{name} is not in TensorRT's plugin registry"
    fc = trt.PluginFieldCollection([trt.PluginField(k, v) for k, v in fields])
    return creator.create_plugin(name, PLUGIN_NAMESPACE, fc, trt.TensorRTPhase.BUILD,
                                 trt.QuickPluginCreationRequest.STRICT_AOT)


def _split_dims(batch, max_pages):
    d, hkv, p = 64, 3, 64
    dims = {
        "q_s": (batch, HEADS, d),
        "sink_k": (batch, hkv, 64, d), "sink_v": (batch, hkv, 64, d), "recent_k": (batch, hkv, 384, d),
        "recent_v": (batch, hkv, 384, d), "k_codes": (40, hkv, p, 16), "k_params": (40, hkv, p, 1, 2),
        "v_codes": (40, hkv, p, 16), "v_params": (40, hkv, p, 1, 2), "k_levels": (hkv, 4), "v_levels": (hkv, 4),
        "block_table": (batch, max_pages), "sink_len": (batch,), "num_pages": (batch,), "recent_len": (batch,),
    }
    return {n: dims[n] for n in SPLIT_INPUTS}  # in the plugin's input order


def _drive(trt, plugin, dims: dict[str, tuple], types: dict[str, str]):
    """What TensorRT's builder does with a plugin: output types, output shapes, then the launch parameters."""
    names = list(dims)
    in_types = [_dtype(trt, types[n]) for n in names]
    out_types = plugin.get_output_data_types(in_types, [len(dims[n]) for n in names])
    builder = FakeExprBuilder()
    out_exprs = plugin.get_output_shapes([[FakeExpr(v) for v in dims[n]] for n in names], [], builder)
    out_shapes = [tuple(e.value for e in exprs) for exprs in out_exprs]
    descs = [trt.DynamicPluginTensorDesc(trt.PluginTensorDesc(dims[n], t, trt.TensorFormat.LINEAR))
             for n, t in zip(names, in_types)]
    descs += [trt.DynamicPluginTensorDesc(trt.PluginTensorDesc(s, t, trt.TensorFormat.LINEAR))
              for s, t in zip(out_shapes, out_types)]
    plugin.set_tactic(0)
    launch, setter = LaunchParamsOut(), SymExprSetter()
    plugin.get_launch_params(None, descs, len(names), launch, setter, builder)
    return out_types, out_shapes, launch, setter


@pytest.mark.parametrize("batch, max_pages", [(1, 1), (3, 10), (8, 129)])
def test_register_plugins_passes_upstream_validators_and_launches_the_plan(trt, batch, max_pages):
    trt, trtp, bundle = trt
    from oscar_export.plugins.trt import register_plugins

    assert register_plugins(bundle, LAYOUT, HEADS, PPS) == (f"oscar::{SPLIT_PLUGIN}", f"oscar::{MERGE_PLUGIN}")
    shapes = DecodeShapes.from_layout(LAYOUT, HEADS, PPS)
    types = tensor_types(lp.TRT_DECODE_SPLIT)
    out_types, out_shapes, launch, setter = _drive(trt, _create(trt, SPLIT_PLUGIN), _split_dims(batch, max_pages),
                                                   types)
    n_splits = shapes.n_splits(max_pages)
    assert out_types == [trt.float32, trt.float32]
    assert out_shapes == [(batch, HEADS, n_splits, 64), (batch, HEADS, n_splits)]
    got = {k: getattr(launch, k).expr.value for k in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z")}
    assert got["block_x"] == 32 * lp.TRT_DECODE_SPLIT.num_warps == 64, got  # a 2-warp kernel: 64 threads
    assert (got["grid_x"], got["grid_y"], got["grid_z"]) == (batch * 3, n_splits, 1)
    assert (got["block_y"], got["block_z"]) == (1, 1) and launch.shared_mem.expr.value == 1024
    assert setter.nbSymExprs == len(SPLIT_EXTRAS) == 4
    extras = [setter.items[i] for i in range(4)]
    assert all(e.dtype == trt.PluginArgDataType.INT32 for e in extras)  # every extra is a SymInt32
    assert [e.expr.value for e in extras] == list(shapes.split_extras(max_pages))
    assert [e.expr.value for e in extras] == [max_pages, PPS, -(-max_pages // PPS), n_splits]
    # the merge, fed the split's outputs
    merge_dims = {"part_o": out_shapes[0], "part_lse": out_shapes[1]}
    out_types, out_shapes, launch, setter = _drive(trt, _create(trt, MERGE_PLUGIN), merge_dims,
                                                   tensor_types(lp.TRT_DECODE_MERGE))
    assert out_types == [trt.bfloat16] and out_shapes == [(batch, HEADS, 64)]
    assert launch.block_x.expr.value == 32 * lp.TRT_DECODE_MERGE.num_warps
    assert launch.grid_x.expr.value == batch * HEADS
    assert setter.nbSymExprs == 1 and setter.items[0].expr.value == n_splits


def test_plugin_rejects_wrong_dtypes_and_attributes(trt):
    trt, trtp, bundle = trt
    from oscar_export.plugins.trt import register_plugins

    register_plugins(bundle, LAYOUT, HEADS, PPS)
    types = {**tensor_types(lp.TRT_DECODE_SPLIT), "q_s": "*bf16"}  # BF16 queries into the kernel's *fp32 pointer
    with pytest.raises(ValueError, match=r"input q_s must be float32 \(the kernel's \*fp32 pointer\)"):
        _drive(trt, _create(trt, SPLIT_PLUGIN), _split_dims(2, 4), types)
    with pytest.raises(AssertionError, match="Unexpected attribute num_heads"):
        _create(trt, SPLIT_PLUGIN, [("num_heads", 9)])


def test_register_plugins_rejects_a_bundle_compiled_with_other_warps(monkeypatch, tmp_path):
    load_tensorrt_plugin(monkeypatch, SOURCES)
    from oscar_export.plugins.trt import register_plugins

    with pytest.raises(ValueError, match="compiled with 4 warps .* the launch plan says 2"):
        register_plugins(_fake_bundle(tmp_path / "b", num_warps=4), LAYOUT, HEADS, PPS)


def test_onnx_plugin_nodes_pass_the_node_rules(trt):
    onnx = pytest.importorskip("onnx")
    trt, trtp, bundle = trt
    from oscar_export.onnx_export import decode_attention_trt_model
    from oscar_export.plugins.trt import register_plugins

    register_plugins(bundle, LAYOUT, HEADS, PPS)
    model = decode_attention_trt_model(LAYOUT, HEADS, SCALE, pages_per_split=PPS)
    elem = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    onnx_of = {"*fp32": onnx.TensorProto.FLOAT, "*bf16": onnx.TensorProto.BFLOAT16, "*fp16": onnx.TensorProto.FLOAT16,
               "*i32": onnx.TensorProto.INT32, "*u8": onnx.TensorProto.UINT8}
    registry = trtp._lib.QDP_REGISTRY
    for node, plan in zip(model.graph.node[-2:], (lp.TRT_DECODE_SPLIT, lp.TRT_DECODE_MERGE)):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        plugin_id = f"{PLUGIN_NAMESPACE}::{node.op_type}"
        assert plugin_id in registry, f"op {node.op_type} is not a registered plugin name"
        assert attrs.pop("plugin_namespace") == PLUGIN_NAMESPACE.encode() and attrs.pop("aot") == 1
        assert set(attrs) <= set(registry[plugin_id].input_attrs), f"undeclared attributes {sorted(attrs)}"
        _create(trt, node.op_type, attrs.items())  # upstream's create_plugin attribute check
        types = tensor_types(plan)
        for name in node.input:
            assert elem[name] == onnx_of[types[name]], f"{node.op_type} input {name}: dtype is not {types[name]}"
    assert list(model.graph.node[-2].input) == list(SPLIT_INPUTS)
    json.dumps([a.name for a in model.graph.node[-2].attribute])
