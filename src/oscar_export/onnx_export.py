"""ONNX form of one OSCAR decode-attention layer, for TensorRT's ONNX-parser route.

The graph holds one node ``OscarDecodeAttention`` in the custom domain ``oscar``, with the layout as
attributes (the TensorRT form, :func:`decode_attention_trt_model`, is the query rotation in standard operators,
once a step, then the two nodes named after the two TensorRT plugins, ``OscarDecodeSplit`` and
``OscarDecodeMerge``: one kernel launch each, over the rotated queries)::

    inputs   q [B, H, D] f32 (model basis)   k_rotation [H_kv, D, D] f32   k_scale [H_kv, D] f32
             sink_k, sink_v [B, H_kv, S0, D] bf16   recent_k, recent_v [B, H_kv, C, D] bf16 (the ring, C = W + 2P)
             k_codes, v_codes [N, H_kv, P, D/4] u8   k_params, v_params f16 (layout.params_shape)
             k_levels, v_levels [H_kv, 4] f32   block_table [B, M] i32   sink_len, num_pages, recent_len [B] i32
    output   out [B, H, D] f32 (stored value basis: the exported o_proj undoes the value rotation)

``reference=True`` also embeds a model-local ONNX *function* with the same domain and name whose body is
the op written in standard ONNX operators (opset 18) — ``reference.decode_attention`` step by step: rotate
the query, unpack the 2-bit codes with BitShift/BitwiseAnd, dequantize ``lo + scale * level``, gather the
pages through the block table, mask, softmax, weighted sum. onnxruntime inlines the function, so the very
node TensorRT would hand to the plugin runs here through its reference definition. The body is generated
for the layout in the node's attributes (``B`` and ``M`` stay symbolic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oscar_export.kernels.aot.launch_plan import TRT_DECODE_SPLIT, trt_io

DOMAIN = "oscar"
OP = "OscarDecodeAttention"
OPSET = 18
#: the queries and what rotates them into the stored key basis (``q_s = (q @ R_K) / d_K``, once a step).
QUERY_INPUTS = ("q", "k_rotation", "k_scale")
#: the decode layer's inputs: the queries (model basis) and their rotation, then the cache tensors in the kernels'
#: order (the launch plan's split-plugin inputs after ``q_s``).
INPUTS = QUERY_INPUTS + tuple(n for n in trt_io(TRT_DECODE_SPLIT)[0] if n not in QUERY_INPUTS + ("q_s",))
#: Triton pointer type -> ONNX element type name (``TensorProto``).
ONNX_TYPES = {"*fp32": "FLOAT", "*fp16": "FLOAT16", "*bf16": "BFLOAT16", "*i32": "INT32", "*u8": "UINT8"}


def _onnx():
    try:
        import onnx
        from onnx import TensorProto, helper
    except ImportError as e:
        raise ImportError("the ONNX export needs onnx: pip install 'oscar-export[onnx]'") from e
    return onnx, TensorProto, helper


def node_attributes(layout, num_heads: int, sm_scale: float) -> dict[str, Any]:
    return {
        "num_heads": num_heads, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
        "page_size": layout.page_size, "sink": layout.sink, "window": layout.window,
        "key_group_size": layout.key.group_size, "value_group_size": layout.value.group_size,
        "key_granularity": layout.key.granularity, "codebook": int(layout.key.codebook or layout.value.codebook),
        "sm_scale": float(sm_scale), "rotate_q": 1,
    }


def _io(layout, num_heads: int, types: dict[str, str] | None = None):
    """Graph inputs and the output ``out``. ``types`` (plugin tensor name -> the kernel's pointer type) gives
    the dtypes of the TensorRT form (its ``q`` is the model's BF16); without it ``q`` and ``out`` are FLOAT (the
    semantic node)."""
    _, T, helper = _onnx()
    if layout.key.bits != 2 or layout.value.bits != 2:  # the reference function below unpacks 2-bit codes
        raise NotImplementedError(f"ONNX export: 2-bit pages only, the layout has {layout.key.bits}-bit keys and "
                                  f"{layout.value.bits}-bit values")
    if layout.packing != "linear":  # ... in linear order, and the TensorRT plugins launch the portable kernels
        raise NotImplementedError(f"ONNX export: linear pages only, the layout has {layout.key.packing!r} key and "
                                  f"{layout.value.packing!r} value pages")
    h, hkv, d = num_heads, layout.num_kv_heads, layout.head_dim
    # the cache tensors' shapes are the layout's (symbolic batch "B" and pool size "N")
    sink, recent = list(layout.sink_shape("B")), list(layout.recent_shape("B"))
    spec = {
        "q": (T.FLOAT, ["B", h, d]), "k_rotation": (T.FLOAT, [hkv, d, d]), "k_scale": (T.FLOAT, [hkv, d]),
        "sink_k": (T.BFLOAT16, sink), "sink_v": (T.BFLOAT16, sink),
        "recent_k": (T.BFLOAT16, recent), "recent_v": (T.BFLOAT16, recent),
        "k_codes": (T.UINT8, list(layout.key_codes_shape("N"))),
        "k_params": (T.FLOAT16, list(layout.key_params_shape("N"))),
        "v_codes": (T.UINT8, list(layout.value_codes_shape("N"))),
        "v_params": (T.FLOAT16, list(layout.value_params_shape("N"))),
        "k_levels": (T.FLOAT, [hkv, 4]), "v_levels": (T.FLOAT, [hkv, 4]), "block_table": (T.INT32, ["B", "M"]),
        "sink_len": (T.INT32, ["B"]), "num_pages": (T.INT32, ["B"]), "recent_len": (T.INT32, ["B"]),
        "out": (T.FLOAT, ["B", h, d]),
    }
    if types is not None:
        spec = {n: (getattr(T, ONNX_TYPES[types[n]]), shape) if n in types else (t, shape)
                for n, (t, shape) in spec.items()}
        spec["q"] = (T.BFLOAT16, spec["q"][1])
    inputs = [helper.make_tensor_value_info(n, *spec[n]) for n in INPUTS]
    output = helper.make_tensor_value_info("out", *spec["out"])
    return inputs, output


class _Body:
    """Appends standard-ONNX nodes; ``c(name, values, dtype)`` makes constants."""

    def __init__(self) -> None:
        self.onnx, self.T, self.h = _onnx()
        self.nodes: list = []
        self.n = 0

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self.n += 1
        out = f"t{self.n}_{op_type.lower()}"
        self.nodes.append(self.h.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def c(self, values, dtype=None) -> str:
        import numpy as np

        arr = np.asarray(values, dtype=dtype or np.int64)
        self.n += 1
        out = f"c{self.n}"
        self.nodes.append(self.h.make_node("Constant", [], [out], value=self.onnx.numpy_helper.from_array(arr)))
        return out


def _unpack(b: _Body, packed: str, d: int, g: int) -> str:
    """``[..., D/4]`` uint8 -> ``[..., D]`` int64 codes (layout.py bit order)."""
    import numpy as np

    ng, q = d // g, g // 4
    x = b.op("Unsqueeze", b.op("Reshape", packed, b.c([0, 0, 0, 0, ng, q])), b.c([-2]))  # [B,M,Hkv,P,NG,1,Q]
    shifted = b.op("BitShift", x, b.c(np.array([0, 2, 4, 6], np.uint8).reshape(4, 1), np.uint8), direction="RIGHT")
    codes = b.op("BitwiseAnd", shifted, b.c(np.array(3, np.uint8), np.uint8))  # [B,M,Hkv,P,NG,4,Q]
    return b.op("Reshape", codes, b.c([0, 0, 0, 0, d]))


def _levels(b: _Body, codes: str, levels: str) -> str:
    """Code -> level per KV head: ``levels [H_kv, 4]`` -> f32 shaped like ``codes [B, M, H_kv, P, D]``."""
    lv = b.op("Reshape", levels, b.c([1, 1, -1, 1, 1, 4]))
    level = [b.op("Squeeze", b.op("Gather", lv, b.c([j]), axis=5), b.c([5])) for j in range(4)]  # [1,1,Hkv,1,1]
    out = b.op("Expand", level[3], b.op("Shape", codes))
    for j in (2, 1, 0):
        out = b.op("Where", b.op("Equal", codes, b.op("Cast", b.c(j), to=b.T.UINT8)), level[j], out)
    return out


def _history(b: _Body, layout, fmt, codes_in: str, params_in: str, levels: str, table: str) -> str:
    """Dequantized pages of every sequence: ``[B, H_kv, M*P, D]`` float32."""
    d = layout.head_dim
    idx = b.op("Cast", table, to=b.T.INT64)
    codes = _unpack(b, b.op("Gather", codes_in, idx, axis=0), d, fmt.group_size)  # [B,M,Hkv,P,D] u8
    lev = _levels(b, codes, levels)  # [B,M,Hkv,P,D] f32
    prm = b.op("Cast", b.op("Gather", params_in, idx, axis=0), to=b.T.FLOAT)
    if fmt.granularity == "token":  # prm [B,M,Hkv,P,NG,2]
        g = fmt.group_size
        lev = b.op("Reshape", lev, b.c([0, 0, 0, 0, d // g, g]))
        scale = b.op("Gather", prm, b.c([0]), axis=5)  # [B,M,Hkv,P,NG,1]
        lo = b.op("Gather", prm, b.c([1]), axis=5)
        x = b.op("Reshape", b.op("Add", lo, b.op("Mul", scale, lev)), b.c([0, 0, 0, 0, d]))
    else:  # prm [B,M,Hkv,2,D]
        scale = b.op("Gather", prm, b.c([0]), axis=3)  # [B,M,Hkv,1,D]
        lo = b.op("Gather", prm, b.c([1]), axis=3)
        x = b.op("Add", lo, b.op("Mul", scale, lev))
    x = b.op("Transpose", x, perm=[0, 2, 1, 3, 4])  # [B,Hkv,M,P,D]
    return b.op("Reshape", x, b.c([0, 0, -1, d]))


def _valid(b: _Body, n: int | str, length: str) -> str:
    """``[B, n]`` bool: slot index < length (``n`` a constant or a scalar tensor name)."""
    limit = b.c(n) if isinstance(n, int) else n
    ar = b.op("Range", b.c(0), limit, b.c(1))
    lengths = b.op("Unsqueeze", b.op("Cast", length, to=b.T.INT64), b.c([1]))
    return b.op("Less", b.op("Unsqueeze", ar, b.c([0])), lengths)


def _ring_valid(b: _Body, layout) -> str:
    """``[B, C]`` bool: the recent ring slots a sequence holds (``reference.recent_valid``): slot ``j`` is held
    iff ``(j - start) mod C < recent_len`` with ``start = (num_pages * P) mod C``."""
    c = layout.recent_slots
    start = b.op("Mod", b.op("Mul", b.op("Cast", "num_pages", to=b.T.INT64), b.c(layout.page_size)), b.c(c))
    ar = b.op("Unsqueeze", b.op("Range", b.c(0), b.c(c), b.c(1)), b.c([0]))  # [1, C]
    off = b.op("Mod", b.op("Add", b.op("Sub", ar, b.op("Unsqueeze", start, b.c([1]))), b.c(c)), b.c(c))  # [B, C]
    return b.op("Less", off, b.op("Unsqueeze", b.op("Cast", "recent_len", to=b.T.INT64), b.c([1])))


def _rotate_queries(b: _Body, q: str, hkv: int, g: int, d: int) -> str:
    """``q_s = (q @ R_K[h]) / d_K[h]`` of FLOAT queries ``q [B, H, D]``, grouped by KV head: ``[B, H_kv, g, D]``."""
    qg = b.op("Reshape", q, b.c([0, hkv, g, d]))
    return b.op("Div", b.op("MatMul", qg, "k_rotation"), b.op("Unsqueeze", "k_scale", b.c([1])))


def reference_function(layout, num_heads: int, sm_scale: float):
    """The ONNX FunctionProto ``oscar.OscarDecodeAttention`` in standard operators (see the module doc)."""
    import numpy as np

    b = _Body()
    T = b.T
    hkv, d, p = layout.num_kv_heads, layout.head_dim, layout.page_size
    qs = _rotate_queries(b, "q", hkv, num_heads // hkv, d)  # [B, H_kv, g, D]
    kh = _history(b, layout, layout.key, "k_codes", "k_params", "k_levels", "block_table")
    vh = _history(b, layout, layout.value, "v_codes", "v_params", "v_levels", "block_table")
    k = b.op("Concat", b.op("Cast", "sink_k", to=T.FLOAT), kh, b.op("Cast", "recent_k", to=T.FLOAT), axis=2)
    v = b.op("Concat", b.op("Cast", "sink_v", to=T.FLOAT), vh, b.op("Cast", "recent_v", to=T.FLOAT), axis=2)
    m = b.op("Gather", b.op("Shape", "block_table"), b.c(1), axis=0)  # scalar M
    hist_len = b.op("Mul", b.op("Cast", "num_pages", to=T.INT64), b.c(p))
    valid = b.op("Concat", _valid(b, layout.sink, "sink_len"), _valid(b, b.op("Mul", m, b.c(p)), hist_len),
                 _ring_valid(b, layout), axis=1)  # [B, T]
    s = b.op("Mul", b.op("MatMul", qs, b.op("Transpose", k, perm=[0, 1, 3, 2])), b.c(np.float32(sm_scale), np.float32))
    mask = b.op("Unsqueeze", valid, b.c([1, 2]))  # [B, 1, 1, T]
    s = b.op("Where", mask, s, b.c(np.float32(-np.inf), np.float32))
    pr = b.op("Softmax", s, axis=-1)
    pr = b.op("Where", b.op("IsNaN", pr), b.c(np.float32(0.0), np.float32), pr)  # nothing to attend -> zeros
    o = b.op("MatMul", pr, v)  # [B, H_kv, g, D]
    b.nodes.append(b.h.make_node("Reshape", [o, b.c([0, num_heads, d])], ["out"]))
    attrs = sorted(node_attributes(layout, num_heads, sm_scale))
    return b.h.make_function(DOMAIN, OP, list(INPUTS), ["out"], b.nodes,
                             [b.h.make_opsetid("", OPSET)], attributes=attrs)


def decode_attention_model(layout, num_heads: int, sm_scale: float, reference: bool = False):
    """The one-node ONNX model (with the reference function embedded if ``reference``)."""
    onnx, _, helper = _onnx()
    if num_heads % layout.num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {layout.num_kv_heads}")
    inputs, output = _io(layout, num_heads)
    node = helper.make_node(OP, list(INPUTS), ["out"], domain=DOMAIN, name="oscar_decode_attention",
                            **node_attributes(layout, num_heads, sm_scale))
    graph = helper.make_graph([node], "oscar_decode_attention_layer", inputs, [output])
    functions = [reference_function(layout, num_heads, sm_scale)] if reference else []
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                              functions=functions, producer_name="oscar-export")
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def decode_attention_trt_model(layout, num_heads: int, sm_scale: float, pages_per_split: int = 8):
    """The TensorRT form: the same inputs, the query rotation ``q_s = (q @ R_K) / d_K`` in standard operators (FP32
    MatMul and Div over the step's queries, once a step: no split program rotates), then ``oscar::OscarDecodeSplit``
    on ``q_s`` -> ``oscar::OscarDecodeMerge``.

    A TensorRT AOT plugin launches one kernel, and decode attention is two (split-K, then the LSE merge),
    so the layer is two plugin nodes (``plugins/trt``). TensorRT's node rules: the op type is the plugin name,
    ``plugin_namespace`` names the namespace, ``aot=1`` selects the AOT implementation, and no attribute the
    plugin does not declare (ours declare none: the layout and ``pages_per_split`` are fixed when
    ``register_plugins`` is called, so the same values must be used there). Every tensor has the dtype of the
    kernel's pointer (launch plan): ``q_s`` FP32, ``out`` BF16; ``q`` is the model's BF16. Not executable by
    onnxruntime (no reference body for the plugins): the semantic one-node model above is what runs here, and the
    rotation nodes alone (tests/oscar_export/test_onnx_export.py).
    """
    onnx, T, helper = _onnx()
    from oscar_export.kernels.aot.launch_plan import TRT_DECODE_MERGE
    from oscar_export.plugins.trt.shapes import MERGE_PLUGIN, PLUGIN_NAMESPACE, SPLIT_PLUGIN, DecodeShapes, tensor_types

    DecodeShapes.from_layout(layout, num_heads, pages_per_split)  # validates heads and pages_per_split
    split_types, merge_types = tensor_types(TRT_DECODE_SPLIT), tensor_types(TRT_DECODE_MERGE)
    inputs, out = _io(layout, num_heads, {**split_types, **merge_types})
    rules = dict(plugin_namespace=PLUGIN_NAMESPACE, aot=1)
    split_in, _, split_out = trt_io(TRT_DECODE_SPLIT)
    merge_in, _, merge_out = trt_io(TRT_DECODE_MERGE)
    h, hkv, d = num_heads, layout.num_kv_heads, layout.head_dim  # n_splits = shapes.n_splits(M), symbolic here
    rotate = _Body()
    qs = _rotate_queries(rotate, rotate.op("Cast", "q", to=T.FLOAT), hkv, h // hkv, d)
    rotate.nodes.append(helper.make_node("Reshape", [qs, rotate.c([0, h, d])], ["q_s"]))  # [B, H, D] f32
    split = helper.make_node(SPLIT_PLUGIN, split_in, split_out, domain=DOMAIN, name="oscar_split", **rules)
    merge = helper.make_node(MERGE_PLUGIN, merge_in, merge_out, domain=DOMAIN, name="oscar_merge", **rules)
    value_info = [helper.make_tensor_value_info("q_s", getattr(T, ONNX_TYPES[split_types["q_s"]]), ["B", h, d]),
                  helper.make_tensor_value_info("part_o", getattr(T, ONNX_TYPES[split_types["part_o"]]),
                                                ["B", h, "n_splits", d]),
                  helper.make_tensor_value_info("part_lse", getattr(T, ONNX_TYPES[split_types["part_lse"]]),
                                                ["B", h, "n_splits"])]
    graph = helper.make_graph([*rotate.nodes, split, merge], "oscar_decode_attention_layer_trt", inputs, [out],
                              value_info=value_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                              producer_name="oscar-export")
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def export_decode_attention_onnx(layout, num_heads: int, sm_scale: float, out_dir: str | Path,
                                 pages_per_split: int = 8) -> list[Path]:
    """Write ``oscar_decode_attention.onnx`` (one node + its reference function; onnxruntime runs it) and
    ``oscar_decode_attention_trt.onnx`` (the two TensorRT plugin nodes) into ``out_dir``."""
    onnx, _, _ = _onnx()
    out_dir = Path(out_dir)
    ref = out_dir / "oscar_decode_attention.onnx"
    trt = out_dir / "oscar_decode_attention_trt.onnx"
    onnx.save(decode_attention_model(layout, num_heads, sm_scale, reference=True), str(ref))
    onnx.save(decode_attention_trt_model(layout, num_heads, sm_scale, pages_per_split), str(trt))
    return [ref, trt]


__all__ = ["DOMAIN", "INPUTS", "ONNX_TYPES", "OP", "QUERY_INPUTS", "decode_attention_model",
           "decode_attention_trt_model", "export_decode_attention_onnx", "node_attributes", "reference_function"]
