"""Shape and argument rules of the OSCAR TensorRT plugins, in plain Python (tested here).

The decode layer becomes two AOT plugins, one kernel launch each (a TensorRT AOT plugin launches exactly
one kernel): ``oscar::OscarDecodeSplit`` (``trt_decode_split_*`` of the bundle) and
``oscar::OscarDecodeMerge`` (``trt_decode_merge_*``). Their kernels take TensorRT's order: input tensors,
int32 extras, output tensors (``kernels/aot/trt_order.py``).

The formulas use only ``+ * //`` so they evaluate both on Python ints (tests, the ONNX rewrite) and on
TensorRT's symbolic shape expressions (inside ``plugin.py``, where ``B`` and ``M`` are symbolic).

    split inputs   SPLIT_INPUTS (q [B, H, D] bf16 ... recent_len [B] i32; block_table [B, M] i32)
    split extras   max_pages = M, pages_per_split, n_page_splits = cdiv(M, pps), n_splits
    split outputs  part_o [B, H, n_splits, D] f32, part_lse [B, H, n_splits] f32
    grid           (B * H_kv, n_splits, 1), block 32 * num_warps
    merge          inputs part_o, part_lse; extra n_splits; output out [B, H, D] bf16; grid (B * H, 1, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPLIT_INPUTS = (
    "q", "k_rotation", "k_scale", "sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes",
    "v_params", "k_levels", "v_levels", "block_table", "sink_len", "num_pages", "recent_len",
)
SPLIT_EXTRAS = ("max_pages", "pages_per_split", "n_page_splits", "n_splits")
SPLIT_OUTPUTS = ("part_o", "part_lse")
MERGE_INPUTS = ("part_o", "part_lse")
MERGE_EXTRAS = ("n_splits",)
MERGE_OUTPUTS = ("out",)
PLUGIN_NAMESPACE = "oscar"
SPLIT_PLUGIN = "OscarDecodeSplit"
MERGE_PLUGIN = "OscarDecodeMerge"
BF16_CHUNK = 64


def cdiv(a: Any, b: Any) -> Any:
    return (a + b - 1) // b


@dataclass(frozen=True)
class DecodeShapes:
    """Shape rules for one layout. ``pages_per_split`` is fixed when the engine is built (a plugin attribute).

    Args:
        num_heads, num_kv_heads, head_dim: H, H_kv, D.
        sink, recent_capacity: S0 and W + P of the layout.
        pages_per_split: INT2 pages per split program.
        num_warps: of the split kernel (block size 32 * num_warps).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sink: int
    recent_capacity: int
    pages_per_split: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.pages_per_split <= 0:
            raise ValueError(f"pages_per_split: expected > 0, got {self.pages_per_split}")

    @classmethod
    def from_layout(cls, layout, num_heads: int, pages_per_split: int) -> "DecodeShapes":
        return cls(num_heads, layout.num_kv_heads, layout.head_dim, layout.sink, layout.recent_capacity, pages_per_split)

    @property
    def bf16_splits(self) -> int:
        return cdiv(self.sink, BF16_CHUNK) + cdiv(self.recent_capacity, BF16_CHUNK)

    def n_splits(self, max_pages: Any) -> Any:
        return cdiv(max_pages, self.pages_per_split) + self.bf16_splits

    def split_extras(self, max_pages: Any) -> tuple[Any, Any, Any, Any]:
        """The int32 extras of the split kernel, in kernel order (``SPLIT_EXTRAS``)."""
        return (max_pages, self.pages_per_split, cdiv(max_pages, self.pages_per_split), self.n_splits(max_pages))

    def split_outputs(self, batch: Any, max_pages: Any) -> tuple[tuple, tuple]:
        n = self.n_splits(max_pages)
        return (batch, self.num_heads, n, self.head_dim), (batch, self.num_heads, n)

    def split_grid(self, batch: Any, max_pages: Any) -> tuple[Any, Any, int]:
        return batch * self.num_kv_heads, self.n_splits(max_pages), 1

    def merge_output(self, batch: Any) -> tuple:
        return batch, self.num_heads, self.head_dim

    def merge_grid(self, batch: Any) -> tuple[Any, int, int]:
        return batch * self.num_heads, 1, 1

    @property
    def block(self) -> int:
        return 32 * self.num_warps


def check_split_inputs(shapes: DecodeShapes, dims: dict[str, tuple]) -> tuple[int, int]:
    """Validate concrete input shapes by name; return ``(B, M)``. Errors name expected vs got."""
    missing = [n for n in SPLIT_INPUTS if n not in dims]
    if missing:
        raise ValueError(f"OscarDecodeSplit: missing inputs {missing}")
    b, h, d = dims["q"]
    if (h, d) != (shapes.num_heads, shapes.head_dim):
        raise ValueError(f"q: expected [B, {shapes.num_heads}, {shapes.head_dim}], got {list(dims['q'])}")
    hkv = shapes.num_kv_heads
    want = {
        "k_rotation": (hkv, d, d), "k_scale": (hkv, d), "sink_k": (b, hkv, shapes.sink, d),
        "sink_v": (b, hkv, shapes.sink, d), "recent_k": (b, hkv, shapes.recent_capacity, d),
        "recent_v": (b, hkv, shapes.recent_capacity, d), "k_levels": (hkv, 4), "v_levels": (hkv, 4),
        "sink_len": (b,), "num_pages": (b,), "recent_len": (b,),
    }
    for name, shape in want.items():
        if tuple(dims[name]) != shape:
            raise ValueError(f"{name}: expected {list(shape)}, got {list(dims[name])}")
    bt = tuple(dims["block_table"])
    if len(bt) != 2 or bt[0] != b or bt[1] <= 0:
        raise ValueError(f"block_table: expected [{b}, M > 0], got {list(bt)}")
    return b, bt[1]


__all__ = [
    "MERGE_EXTRAS", "MERGE_INPUTS", "MERGE_OUTPUTS", "MERGE_PLUGIN", "PLUGIN_NAMESPACE", "SPLIT_EXTRAS",
    "SPLIT_INPUTS", "SPLIT_OUTPUTS", "SPLIT_PLUGIN", "DecodeShapes", "cdiv", "check_split_inputs",
]
