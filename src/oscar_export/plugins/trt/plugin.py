"""TensorRT (>= 10.9) AOT Quick-Deployable-Plugin definitions for the OSCAR decode layer.

NOT EXECUTED with a real TensorRT: TensorRT's native library cannot be installed on the machines this project
was built on. What IS executed (tests/plugins/test_trt_plugin.py): TensorRT's own pure-Python
``tensorrt.plugin`` sources from the ``tensorrt-cu13-bindings`` wheel, with only the native ``tensorrt``
module replaced by a stub, run ``register_plugins()`` through their validators and drive
``get_output_shapes`` / ``get_launch_params`` with a fake expression builder. The PTX comes from the kernel
bundle, whose build path was loaded and checked on an H200 through the CUDA driver API.

``register_plugins(bundle_dir, layout, num_heads, pages_per_split)`` registers

* ``oscar::OscarDecodeSplit`` — inputs ``SPLIT_INPUTS`` (the first, ``q_s``: the step's fp32 queries in the stored
  key basis; the ONNX form computes them once a step in standard operators before this node); outputs ``part_o``,
  ``part_lse``;
  AOT kernel ``trt_decode_split_<tag>`` (PTX of ``arch``, default sm_80: PTX JIT-compiles on any newer GPU);
* ``oscar::OscarDecodeMerge`` — inputs ``part_o``, ``part_lse``; output ``out``; kernel ``trt_decode_merge_<tag>``.

Neither plugin declares attributes (the layout and ``pages_per_split`` are fixed at registration), so an ONNX
node for them carries only ``plugin_namespace`` and ``aot`` (``oscar_export/onnx_export.py``). Tensor names,
dtypes (the kernel's pointer types, checked when TensorRT asks for the output types), extras, grid and
``block_x = 32 * num_warps`` come from the launch plan; the compiled binary's warps are checked against it.

No ``from __future__ import annotations`` in this file: upstream's ``_parse_register_inputs`` calls
``issubclass(param.annotation, TensorDesc)`` on ``inspect.signature`` without ``eval_str``, so string
annotations would make every tensor look like an attribute.

Known gap, stated rather than hidden: Triton >= 3.3 kernels declare two trailing scratch pointers that
TensorRT's AOT launcher does not know about (the bundle asserts both scratch sizes are 0, so the kernel never
reads them, but the parameter slots exist); whether TensorRT tolerates them is unverified here. The engine
path covers decode attention only; cache writes (demotion) happen outside the engine.
"""

import inspect
from pathlib import Path
from typing import Tuple, Union

from oscar_export.kernels.aot.launch_plan import TRT_DECODE_MERGE, TRT_DECODE_SPLIT

from .shapes import (
    MERGE_INPUTS,
    MERGE_OUTPUTS,
    MERGE_PLUGIN,
    PLUGIN_NAMESPACE,
    SPLIT_INPUTS,
    SPLIT_OUTPUTS,
    SPLIT_PLUGIN,
    DecodeShapes,
    tensor_types,
)

INSTALL_HINT = "the OSCAR TensorRT plugins need TensorRT >= 10.9 with its Python plugin API: pip install tensorrt"
#: Triton pointer type -> TensorRT DataType attribute name.
TRT_DTYPES = {"*fp32": "float32", "*fp16": "float16", "*bf16": "bfloat16", "*i32": "int32", "*u8": "uint8"}


def _require_trt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return trt, trtp


def _with_signature(fn, params, returns):
    """Give ``fn(*args)`` the explicit signature upstream's validators read (names from the launch plan)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    fn.__signature__ = inspect.Signature([inspect.Parameter(n, kind, annotation=a) for n, a in params],
                                         return_annotation=returns)
    return fn


def register_plugins(bundle_dir: Union[str, Path], layout, num_heads: int, pages_per_split: int = 8,
                     arch: str = "sm_80") -> Tuple[str, str]:
    """Register both plugins for ``layout`` with the bundle in ``bundle_dir`` (see the module doc)."""
    trt, trtp = _require_trt()
    from oscar_export.kernels.aot.bundle import layout_tag
    from oscar_export.kernels.aot.manifest import read_manifest

    manifest = read_manifest(bundle_dir)
    tag = layout_tag(layout, num_heads)
    split_e = manifest.entry(f"trt_decode_split_{tag}", arch)
    merge_e = manifest.entry(f"trt_decode_merge_{tag}", arch)
    for entry, plan in ((split_e, TRT_DECODE_SPLIT), (merge_e, TRT_DECODE_MERGE)):
        if entry.spec.num_warps != plan.num_warps or [p.name for p in entry.spec.params] != plan.param_names:
            raise ValueError(f"{bundle_dir}: {entry.name} was compiled with {entry.spec.num_warps} warps and "
                             f"parameters {[p.name for p in entry.spec.params]}; the launch plan says "
                             f"{plan.num_warps} and {plan.param_names}: rebuild the bundle")
    split_ptx = manifest.binary(split_e, "ptx").decode()
    merge_ptx = manifest.binary(merge_e, "ptx").decode()
    shapes = DecodeShapes.from_layout(layout, num_heads, pages_per_split)
    split_id, merge_id = f"{PLUGIN_NAMESPACE}::{SPLIT_PLUGIN}", f"{PLUGIN_NAMESPACE}::{MERGE_PLUGIN}"
    split_types, merge_types = tensor_types(TRT_DECODE_SPLIT), tensor_types(TRT_DECODE_MERGE)
    dtype = lambda triton_type: getattr(trt, TRT_DTYPES[triton_type])  # noqa: E731
    desc, aot_returns = trtp.TensorDesc, Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                               trtp.SymExprs]

    def check_dtypes(plugin, names, tensors, types):
        for name, t in zip(names, tensors):
            if t.dtype != dtype(types[name]):
                raise ValueError(f"{plugin}: input {name} must be {TRT_DTYPES[types[name]]} (the kernel's "
                                 f"{types[name]} pointer), got {t.dtype}")

    def split_desc(*tensors):
        check_dtypes(split_id, SPLIT_INPUTS, tensors, split_types)
        named = dict(zip(SPLIT_INPUTS, tensors))
        b, m = named["q_s"].shape_expr[0], named["block_table"].shape_expr[1]
        shape_o, shape_lse = shapes.split_outputs(b, m)
        return tuple(trtp.from_shape_expr(s, dtype=dtype(split_types[n]))
                     for n, s in zip(SPLIT_OUTPUTS, (shape_o, shape_lse)))

    def split_aot(*args):
        named = dict(zip(SPLIT_INPUTS, args))
        b, m = named["q_s"].shape_expr[0], named["block_table"].shape_expr[1]
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = shapes.split_grid(b, m)
        launch.block_x = 32 * split_e.spec.num_warps
        launch.shared_mem = split_e.shared
        values = shapes.split_extras(m)
        extras = trtp.SymIntExprs(len(values))
        for i, v in enumerate(values):
            extras[i] = trtp.SymInt32(v)
        return split_e.symbol, split_ptx, launch, extras

    def merge_desc(*tensors):
        check_dtypes(merge_id, MERGE_INPUTS, tensors, merge_types)
        b = tensors[0].shape_expr[0]
        (out_name,) = MERGE_OUTPUTS
        return trtp.from_shape_expr(shapes.merge_output(b), dtype=dtype(merge_types[out_name]))

    def merge_aot(*args):
        part_o = args[MERGE_INPUTS.index("part_o")]
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = shapes.merge_grid(part_o.shape_expr[0])
        launch.block_x = 32 * merge_e.spec.num_warps
        launch.shared_mem = merge_e.shared
        extras = trtp.SymIntExprs(1)
        extras[0] = trtp.SymInt32(part_o.shape_expr[2])  # n_splits
        return merge_e.symbol, merge_ptx, launch, extras

    for plugin_id, inputs, outputs, describe, aot in (
        (split_id, SPLIT_INPUTS, SPLIT_OUTPUTS, split_desc, split_aot),
        (merge_id, MERGE_INPUTS, MERGE_OUTPUTS, merge_desc, merge_aot),
    ):
        outs = Tuple[(desc,) * len(outputs)]
        returns = outs if len(outputs) > 1 else desc
        trtp.register(plugin_id)(_with_signature(describe, [(n, desc) for n in inputs], returns))
        tail = [("outputs", outs), ("tactic", int)]
        trtp.aot_impl(plugin_id)(_with_signature(aot, [(n, desc) for n in inputs] + tail, aot_returns))
    return split_id, merge_id


__all__ = ["INSTALL_HINT", "TRT_DTYPES", "register_plugins"]
