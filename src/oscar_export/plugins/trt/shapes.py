"""Shape and argument rules of the OSCAR TensorRT plugins, in plain Python (tested here).

The decode layer becomes two AOT plugins, one kernel launch each (a TensorRT AOT plugin launches exactly
one kernel): ``oscar::OscarDecodeSplit`` (``trt_decode_split_*`` of the bundle) and
``oscar::OscarDecodeMerge`` (``trt_decode_merge_*``). Their tensor names, int32 extras, dtypes, warps and
grid rules are not stated here: they are read from the launch plan (``kernels/aot/launch_plan.py``,
``TRT_DECODE_SPLIT`` / ``TRT_DECODE_MERGE``: input tensors, int32 extras, output tensors).

The rules use only ``+ * //`` with ints on the right, so they evaluate both on Python ints (tests, the ONNX
export) and on TensorRT's symbolic ``SymInt32``/``ShapeExpr`` values (inside ``plugin.py``).

    split   inputs SPLIT_INPUTS (``q_s [B, H, D]`` fp32: the step's queries in the stored key basis, rotated once a
            step before the plugin); extras max_pages = M, pages_per_split, n_page_splits, n_splits;
            outputs part_o [B, H, n_splits, D] f32, part_lse [B, H, n_splits] f32; grid (B * H_kv, n_splits, 1)
    merge   inputs part_o, part_lse; extra n_splits; output out [B, H, D] bf16; grid (B * H, 1, 1)
    block   32 * num_warps of each kernel (the plan's; the compiled binary's, checked in plugin.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oscar_export.kernels.aot.launch_plan import BF16_CHUNK, TRT_DECODE_MERGE, TRT_DECODE_SPLIT, tensor_name, trt_io

SPLIT_INPUTS, SPLIT_EXTRAS, SPLIT_OUTPUTS = (tuple(x) for x in trt_io(TRT_DECODE_SPLIT))
MERGE_INPUTS, MERGE_EXTRAS, MERGE_OUTPUTS = (tuple(x) for x in trt_io(TRT_DECODE_MERGE))
PLUGIN_NAMESPACE = "oscar"
SPLIT_PLUGIN = "OscarDecodeSplit"
MERGE_PLUGIN = "OscarDecodeMerge"


def cdiv(a: Any, b: Any) -> Any:
    return (a + (b - 1)) // b


def tensor_types(plan) -> dict[str, str]:
    """Plugin tensor name -> the kernel's Triton pointer type (``"*bf16"``), for inputs and outputs."""
    return {tensor_name(n): t for n, t in plan.params if t.startswith("*")}


@dataclass(frozen=True)
class DecodeShapes:
    """Shape rules for one layout. ``pages_per_split`` is fixed when the plugins are registered.

    Args:
        num_heads, num_kv_heads, head_dim: H, H_kv, D.
        sink, recent_slots: S0 and the recent ring's slots C = W + 2P of the layout.
        pages_per_split: INT2 pages per split program.
        layout: the ``KVCacheLayout`` the numbers come from (:meth:`from_layout`), whose pool shapes
            :func:`check_split_inputs` reads; None where only the launch rules are needed.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sink: int
    recent_slots: int
    pages_per_split: int
    layout: Any = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.pages_per_split <= 0:
            raise ValueError(f"pages_per_split: expected > 0, got {self.pages_per_split}")

    @classmethod
    def from_layout(cls, layout, num_heads: int, pages_per_split: int) -> "DecodeShapes":
        return cls(num_heads, layout.num_kv_heads, layout.head_dim, layout.sink, layout.recent_slots, pages_per_split,
                   layout)

    @property
    def _constexprs(self) -> dict[str, int]:
        """The integer constexprs the plan's rules read."""
        return {"H_KV": self.num_kv_heads, "S0": self.sink, "RC": self.recent_slots, "BN": BF16_CHUNK}

    def split_scalars(self, max_pages: Any) -> dict[str, Any]:
        return TRT_DECODE_SPLIT.scalars({"max_pages": max_pages, "pages_per_split": self.pages_per_split},
                                        self._constexprs)

    def n_splits(self, max_pages: Any) -> Any:
        return self.split_scalars(max_pages)["n_splits"]

    def split_extras(self, max_pages: Any) -> tuple[Any, ...]:
        """The int32 extras of the split kernel, in kernel order (``SPLIT_EXTRAS``)."""
        a = self.split_scalars(max_pages)
        return tuple(a[n] for n in SPLIT_EXTRAS)

    def split_outputs(self, batch: Any, max_pages: Any) -> tuple[tuple, tuple]:
        n = self.n_splits(max_pages)
        return (batch, self.num_heads, n, self.head_dim), (batch, self.num_heads, n)

    def split_grid(self, batch: Any, max_pages: Any) -> tuple[Any, Any, Any]:
        return TRT_DECODE_SPLIT.grid_for({"B": batch, **self.split_scalars(max_pages)}, self._constexprs)

    def merge_output(self, batch: Any) -> tuple:
        return batch, self.num_heads, self.head_dim

    def merge_grid(self, batch: Any) -> tuple[Any, Any, Any]:
        return TRT_DECODE_MERGE.grid_for({"rows": batch * self.num_heads}, {})

    @property
    def block(self) -> int:
        """Threads per block of the split kernel (32 x its warps)."""
        return TRT_DECODE_SPLIT.block

    @property
    def merge_block(self) -> int:
        return TRT_DECODE_MERGE.block


def pool_shapes(layout, num_pages: int) -> dict[str, tuple[int, ...]]:
    """The four page-pool inputs of the split plugin for a pool of ``num_pages`` pages: ``k_codes`` / ``v_codes``
    ``[N, H_kv, P, D * bits / 8]`` uint8, ``k_params`` / ``v_params`` fp16 (``[N, H_kv, P, D / G, 2]`` token,
    ``[N, H_kv, 2, D]`` channel), as ``KVCacheLayout`` defines them (and ``onnx_export.py`` declares them)."""
    return {"k_codes": layout.key_codes_shape(num_pages), "k_params": layout.key_params_shape(num_pages),
            "v_codes": layout.value_codes_shape(num_pages), "v_params": layout.value_params_shape(num_pages)}


def check_split_inputs(shapes: DecodeShapes, dims: dict[str, tuple]) -> tuple[int, int]:
    """Validate concrete input shapes by name (the page pools' against ``shapes.layout``, their page count ``N``
    taken from ``k_codes``); return ``(B, M)``. Errors name expected vs got."""
    missing = [n for n in SPLIT_INPUTS if n not in dims]
    if missing:
        raise ValueError(f"OscarDecodeSplit: missing inputs {missing}")
    if shapes.layout is None:
        raise ValueError("check_split_inputs: the page pools' shapes come from the layout; build the shapes with "
                         "DecodeShapes.from_layout")
    b, h, d = dims["q_s"]
    if (h, d) != (shapes.num_heads, shapes.head_dim):
        raise ValueError(f"q_s: expected [B, {shapes.num_heads}, {shapes.head_dim}], got {list(dims['q_s'])}")
    hkv = shapes.num_kv_heads
    want = {
        "sink_k": (b, hkv, shapes.sink, d),
        "sink_v": (b, hkv, shapes.sink, d), "recent_k": (b, hkv, shapes.recent_slots, d),
        "recent_v": (b, hkv, shapes.recent_slots, d), "k_levels": (hkv, 4), "v_levels": (hkv, 4),
        "sink_len": (b,), "num_pages": (b,), "recent_len": (b,),
    }
    n = tuple(dims["k_codes"])[0] if len(dims["k_codes"]) else 0
    if n <= 0:
        raise ValueError(f"k_codes: expected a pool of N > 0 pages, got {list(dims['k_codes'])}")
    want.update(pool_shapes(shapes.layout, n))
    for name, shape in want.items():
        if tuple(dims[name]) != tuple(shape):
            raise ValueError(f"{name}: expected {list(shape)}, got {list(dims[name])}")
    bt = tuple(dims["block_table"])
    if len(bt) != 2 or bt[0] != b or bt[1] <= 0:
        raise ValueError(f"block_table: expected [{b}, M > 0], got {list(bt)}")
    return b, bt[1]


__all__ = [
    "MERGE_EXTRAS", "MERGE_INPUTS", "MERGE_OUTPUTS", "MERGE_PLUGIN", "PLUGIN_NAMESPACE", "SPLIT_EXTRAS",
    "SPLIT_INPUTS", "SPLIT_OUTPUTS", "SPLIT_PLUGIN", "DecodeShapes", "cdiv", "check_split_inputs", "pool_shapes",
    "tensor_types",
]
