"""ONNX form of the decode-attention layer: checker, shape inference, and onnxruntime through the node's
reference function, compared with ``reference.decode_attention``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from oscar_export.kernels import reference  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout, PagedKV  # noqa: E402
from oscar_export.kernels.transform import LayerTransform  # noqa: E402
from oscar_export.onnx_export import (  # noqa: E402
    DOMAIN,
    INPUTS,
    OP,
    decode_attention_model,
    decode_attention_trt_model,
    export_decode_attention_onnx,
    node_attributes,
)

SCALE = 0.125


def _case(layout, lengths, heads, seed=0, codebook=False):
    g = torch.Generator().manual_seed(seed)
    h, d = layout.num_kv_heads, layout.head_dim
    t = LayerTransform.identity(h, d, 0.95, 0.9)
    t = replace(t, k_rotation=torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float(),
                k_scale=torch.rand(h, d, generator=g) + 0.5)
    if codebook:
        lv = torch.tensor([0.0, 0.8, 2.1, 3.0])
        t = replace(t, k_levels=lv.expand(h, 4).contiguous(),
                    v_levels=lv.flip(0).neg().add(3).expand(h, 4).contiguous())
    max_pages = max(1, max(layout.pages_for(n) for n in lengths))
    st = PagedKV.allocate(layout, len(lengths), pool_pages=len(lengths) * max_pages + 2, max_pages=max_pages)
    free = list(range(st.k_codes.shape[0]))[::-1]
    for b, n in enumerate(lengths):
        reference.append_tokens(st, b, torch.randn(h, n, d, generator=g) * 2, torch.randn(h, n, d, generator=g),
                                layout, t, free.pop)
    q = torch.randn(len(lengths), heads, d, generator=g)
    return t, st, q


def _run(model, t, st, q):
    from onnx import TensorProto

    feeds = dict(q=q, k_rotation=t.k_rotation, k_scale=t.k_scale, sink_k=st.sink_k, sink_v=st.sink_v,
                 recent_k=st.recent_k, recent_v=st.recent_v, k_codes=st.k_codes, k_params=st.k_params,
                 v_codes=st.v_codes, v_params=st.v_params, k_levels=t.k_levels, v_levels=t.v_levels,
                 block_table=st.block_table, sink_len=st.sink_len, num_pages=st.num_pages, recent_len=st.recent_len)
    assert list(feeds) == list(INPUTS)
    ov = {}
    for k, v in feeds.items():
        v = v.contiguous()
        if v.dtype == torch.bfloat16:  # numpy has no bfloat16: hand onnxruntime the raw bits
            ov[k] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                v.view(torch.int16).numpy().view(np.uint16), onnx_element_type=TensorProto.BFLOAT16)
        else:
            ov[k] = ort.OrtValue.ortvalue_from_numpy(v.numpy())
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, ov)[0])


def _reference(layout, t, st, q):
    qs = t.transform_queries(q[:, :, None]).squeeze(2)
    return reference.decode_attention(qs, st, layout, t.k_levels, t.v_levels, SCALE)


@pytest.mark.parametrize(
    "gran, heads, kv, codebook", [("token", 6, 2, False), ("channel", 6, 2, False), ("token", 4, 4, True),
                                  ("channel", 8, 2, True)],
)
def test_onnxruntime_matches_reference(gran, heads, kv, codebook):
    layout = KVCacheLayout.default(kv, 64, key_granularity=gran, sink=16, window=32, page_size=16)
    if codebook:
        layout = replace(layout, key=replace(layout.key, codebook=True), value=replace(layout.value, codebook=True))
    t, st, q = _case(layout, [1, 15, 16, 48, 49, 100, 173], heads, codebook=codebook)
    assert int(st.num_pages.max()) >= 5
    model = decode_attention_model(layout, heads, SCALE, reference=True)
    got = _run(model, t, st, q)
    ref = _reference(layout, t, st, q)
    err = (got - ref).abs().max().item()
    print(f"{gran} H={heads} H_kv={kv} codebook={codebook}: onnxruntime vs reference max |diff| = {err:.3g}")
    assert err < 1e-5, err
    # the history really is read: corrupt one used page and the output moves (and still matches the reference)
    page = int(st.block_table[-1, 0])
    st.k_codes[page] ^= 0b01010101
    st.v_params[page] *= 2
    got2, ref2 = _run(model, t, st, q), _reference(layout, t, st, q)
    assert (got2 - got).abs().max().item() > 1e-3
    assert (got2 - ref2).abs().max().item() < 1e-5


def test_model_checks_and_shapes(tmp_path):
    layout = KVCacheLayout.default(3, 64)
    ref_path, trt_path = export_decode_attention_onnx(layout, 9, SCALE, tmp_path)
    m = onnx.load(str(ref_path))
    onnx.checker.check_model(m, full_check=True)
    assert [n.op_type for n in m.graph.node] == [OP] and m.graph.node[0].domain == DOMAIN
    assert [f.name for f in m.functions] == [OP]  # the reference body travels with the node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in m.graph.node[0].attribute}
    want = node_attributes(layout, 9, SCALE)
    assert attrs["num_heads"] == 9 and attrs["page_size"] == 64 and attrs["key_granularity"] == b"token"
    assert set(attrs) == set(want)
    ref = decode_attention_model(layout, 9, SCALE, reference=True)
    inferred = onnx.shape_inference.infer_shapes(ref, strict_mode=True)
    out = inferred.graph.output[0].type.tensor_type
    assert [d.dim_param or d.dim_value for d in out.shape.dim] == ["B", 9, 64]


def test_tensorrt_form_matches_plugin_shape_rules(tmp_path):
    from oscar_export.plugins.trt.shapes import MERGE_PLUGIN, SPLIT_PLUGIN, DecodeShapes

    layout = KVCacheLayout.default(3, 64)
    m = decode_attention_trt_model(layout, 9, SCALE, pages_per_split=4)
    onnx.checker.check_model(m, full_check=True)
    # the query rotation once a step in standard operators, then the two plugin nodes
    *rotation, split, merge = m.graph.node
    assert [(n.domain, n.op_type) for n in (split, merge)] == [(DOMAIN, SPLIT_PLUGIN), (DOMAIN, MERGE_PLUGIN)]
    assert rotation and all(n.domain == "" for n in rotation)
    assert [i.name for i in m.graph.input] == list(INPUTS)
    assert split.input[0] == "q_s" and set(split.input[1:]) <= set(INPUTS) - {"q"}
    for node in (split, merge):  # TensorRT's node rules (checked against the registry in test_trt_plugin.py)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"plugin_namespace": b"oscar", "aot": 1}, attrs
    elem = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.output, *m.graph.value_info]}
    assert elem["q"] == elem["out"] == onnx.TensorProto.BFLOAT16  # the model's queries; the merge's *bf16 output
    assert elem["q_s"] == onnx.TensorProto.FLOAT  # the split kernel's *fp32 stored-basis queries
    assert not m.functions  # TensorRT must map the nodes to its plugins, not inline a body
    shapes = DecodeShapes.from_layout(layout, 9, 4)
    vi = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in m.graph.value_info}
    assert vi["part_o"] == ["B", 9, "n_splits", 64] and vi["part_lse"] == ["B", 9, "n_splits"]
    po, pl = shapes.split_outputs(2, 10)  # concrete: B = 2, M = 10 pages
    assert po == (2, 9, 3 + 1 + 6, 64) and pl == po[:3]  # cdiv(10, 4) page splits + sink 1 + the ring's 6 chunks
    out = [d.dim_param or d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim]
    assert out == list(shapes.merge_output("B"))


@pytest.mark.parametrize("heads, kv", [(9, 3), (4, 4), (8, 2)])
def test_tensorrt_form_rotates_the_queries_once(heads, kv):
    """The TensorRT form's nodes before the split plugin, run by onnxruntime: ``q_s = (q @ R_K) / d_K`` per KV head
    in fp32 from the BF16 model-basis queries (``decode_step.rotate_queries``), the one rotation of the step."""
    from oscar_export.kernels.decode_step import rotate_queries

    layout = KVCacheLayout.default(kv, 64)
    m = decode_attention_trt_model(layout, heads, SCALE, pages_per_split=4)
    *rotation, _, _ = m.graph.node
    h = onnx.helper
    graph = h.make_graph(rotation, "rotation", [i for i in m.graph.input if i.name in ("q", "k_rotation", "k_scale")],
                         [h.make_tensor_value_info("q_s", onnx.TensorProto.FLOAT, ["B", heads, 64])])
    sub = h.make_model(graph, opset_imports=list(m.opset_import))
    sub.ir_version = m.ir_version
    onnx.checker.check_model(sub, full_check=True)
    t, _, q = _case(layout, [1], heads, seed=3)
    q = q.bfloat16()
    feeds = {"q": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(q.view(torch.int16).numpy().view(np.uint16),
                                                                  onnx_element_type=onnx.TensorProto.BFLOAT16),
             "k_rotation": ort.OrtValue.ortvalue_from_numpy(t.k_rotation.numpy()),
             "k_scale": ort.OrtValue.ortvalue_from_numpy(t.k_scale.numpy())}
    sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, feeds)[0])
    want = rotate_queries(q, t)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < 1e-5, err


def test_bad_heads():
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention_model(KVCacheLayout.default(3, 64), 8, SCALE)


def test_4bit_keys_refused():
    """4-bit key pages (``layout.with_key_bits(4)``) have no ONNX form yet: refused, not exported as 2-bit."""
    lay = KVCacheLayout.default(2, 64).with_key_bits(4)
    for build in (decode_attention_model, decode_attention_trt_model):
        with pytest.raises(NotImplementedError, match="2-bit pages only, the layout has 4-bit keys"):
            build(lay, 4, SCALE)


def test_mma16_pages_refused():
    """The reference function unpacks linear codes, so an mma16 layout is refused (its ONNX graph would compute
    attention over scrambled codes, without an error)."""
    lay = KVCacheLayout.default(2, 64, packing="mma16")
    for build in (decode_attention_model, decode_attention_trt_model):
        with pytest.raises(NotImplementedError, match="linear pages only, the layout has 'mma16' key and 'mma16' "
                                                      "value pages"):
            build(lay, 8, SCALE)
