"""TensorRT (>= 10.9) AOT Quick-Deployable-Plugin definitions for the OSCAR decode layer.

NOT EXECUTED: TensorRT cannot be installed on the machines this project was built on. The shape and
argument rules these definitions call are in ``shapes.py`` and are tested; the PTX they return comes from
the kernel bundle, whose build path was loaded and checked on an H200 through the CUDA driver API.

``register_plugins(bundle_dir, layout, num_heads, pages_per_split)`` registers

* ``oscar::OscarDecodeSplit`` — inputs ``SPLIT_INPUTS``; outputs ``part_o``, ``part_lse``;
  AOT kernel ``trt_decode_split_<tag>`` (PTX of ``arch``, default sm_80: PTX JIT-compiles on any newer GPU);
* ``oscar::OscarDecodeMerge`` — inputs ``part_o``, ``part_lse``; output ``out``; kernel ``trt_decode_merge_<tag>``.

Known gaps, stated rather than hidden: Triton >= 3.3 kernels declare two trailing scratch pointers that
TensorRT's AOT launcher does not know about (the bundle asserts both scratch sizes are 0, so the kernel
never reads them, but the launch still has to supply the slots); whether TensorRT does is unverified here.
The engine path covers decode attention only; cache writes (demotion) happen outside the engine.
"""

from __future__ import annotations

from pathlib import Path

from .shapes import MERGE_PLUGIN, PLUGIN_NAMESPACE, SPLIT_PLUGIN, DecodeShapes

INSTALL_HINT = "the OSCAR TensorRT plugins need TensorRT >= 10.9 with its Python plugin API: pip install tensorrt"


def _require_trt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return trt, trtp


def register_plugins(bundle_dir: str | Path, layout, num_heads: int, pages_per_split: int = 8, arch: str = "sm_80"):
    """Register both plugins for ``layout`` with the bundle in ``bundle_dir`` (see the module doc)."""
    trt, trtp = _require_trt()
    from oscar_export.kernels.aot.bundle import layout_tag  # pragma: no cover - after the import guard
    from oscar_export.kernels.aot.manifest import read_manifest

    manifest = read_manifest(bundle_dir)
    tag = layout_tag(layout, num_heads)
    split_e = manifest.entry(f"trt_decode_split_{tag}", arch)
    merge_e = manifest.entry(f"trt_decode_merge_{tag}", arch)
    split_ptx = manifest.binary(split_e, "ptx").decode()
    merge_ptx = manifest.binary(merge_e, "ptx").decode()
    shapes = DecodeShapes.from_layout(layout, num_heads, pages_per_split)
    split_id, merge_id = f"{PLUGIN_NAMESPACE}::{SPLIT_PLUGIN}", f"{PLUGIN_NAMESPACE}::{MERGE_PLUGIN}"

    @trtp.register(split_id)
    def _split_desc(q: trtp.TensorDesc, k_rotation: trtp.TensorDesc, k_scale: trtp.TensorDesc,
                    sink_k: trtp.TensorDesc, sink_v: trtp.TensorDesc, recent_k: trtp.TensorDesc,
                    recent_v: trtp.TensorDesc, k_codes: trtp.TensorDesc, k_params: trtp.TensorDesc,
                    v_codes: trtp.TensorDesc, v_params: trtp.TensorDesc, k_levels: trtp.TensorDesc,
                    v_levels: trtp.TensorDesc, block_table: trtp.TensorDesc, sink_len: trtp.TensorDesc,
                    num_pages: trtp.TensorDesc, recent_len: trtp.TensorDesc):
        b, m = q.shape_expr[0], block_table.shape_expr[1]
        po, pl = shapes.split_outputs(b, m)
        return trtp.from_shape_expr(po, dtype=trt.float32), trtp.from_shape_expr(pl, dtype=trt.float32)

    @trtp.aot_impl(split_id)
    def _split_aot(q, k_rotation, k_scale, sink_k, sink_v, recent_k, recent_v, k_codes, k_params, v_codes,
                   v_params, k_levels, v_levels, block_table, sink_len, num_pages, recent_len, outputs, tactic):
        b, m = q.shape_expr[0], block_table.shape_expr[1]
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = shapes.split_grid(b, m)
        launch.block_x = shapes.block
        launch.shared_mem = split_e.shared
        extras = trtp.SymIntExprs(4)
        for i, v in enumerate(shapes.split_extras(m)):
            extras[i] = trtp.SymInt32(v)
        return split_e.symbol, split_ptx, launch, extras

    @trtp.register(merge_id)
    def _merge_desc(part_o: trtp.TensorDesc, part_lse: trtp.TensorDesc):
        return trtp.from_shape_expr(shapes.merge_output(part_o.shape_expr[0]), dtype=trt.bfloat16)

    @trtp.aot_impl(merge_id)
    def _merge_aot(part_o, part_lse, outputs, tactic):
        b = part_o.shape_expr[0]
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = shapes.merge_grid(b)
        launch.block_x = 32 * merge_e.spec.num_warps
        launch.shared_mem = merge_e.shared
        extras = trtp.SymIntExprs(1)
        extras[0] = trtp.SymInt32(part_o.shape_expr[2])
        return merge_e.symbol, merge_ptx, launch, extras

    return split_id, merge_id


__all__ = ["INSTALL_HINT", "register_plugins"]
