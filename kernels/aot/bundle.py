"""Which serving kernels go into a model's bundle, and the host-side launch plan a plugin follows.

A bundle is compiled for one model shape and one artifact layout (every constexpr fixed: head counts,
head_dim, page size, windows, row formats, softmax scale). For that layout it holds:

* ``quant_pack_{k,v}[_rot]`` — ``kernels/quant_pack.py:_quant_pack_kernel``: demotion (rows already in the
  stored basis) and, with ``_rot``, prefill pages straight from model-basis rows (``(x R) d - mu`` rounded
  through BF16, as the wrapper does). Grid ``(N pages, H_kv)``.
* ``decode_split`` — ``kernels/decode_attention.py:_decode_split_kernel`` with the query rotation fused
  (``ROTATE_Q``), BF16 queries. Grid ``(B * H_kv, n_splits)``.
* ``decode_merge`` — ``_merge_kernel``, BF16 output. Grid ``(B * H,)``.
* ``trt_decode_split`` / ``trt_decode_merge`` — the same two kernels in TensorRT's AOT-plugin parameter
  order (``trt_order.py``: inputs, int32 extras, outputs) for ``plugins/trt``.
* the two probe kernels (``probe.py``) as a self-test.

num_warps/num_stages are the JIT wrappers' (quant_pack: 4 warps, merge: 4, both Triton's default 3
stages; split: ``decode_attention.SPLIT_WARPS``/``SPLIT_STAGES`` with ``NB = PAGE_SLOTS`` pages per iteration;
``FAST_UNPACK`` as the wrapper sets it on a GPU) so the AOT binaries compute what the JIT launches compute, bit
for bit.
:func:`decode_plan` reproduces the wrapper's split arithmetic for a host that launches the binaries itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decode_attention import PAGE_SLOTS, SPLIT_STAGES, SPLIT_WARPS, gq_pad
from ..layout import KVCacheLayout, RowFormat
from .probe import probe_specs
from .spec import KernelSpec, Param

_QP = "oscar_export.kernels.quant_pack:_quant_pack_kernel"
_SPLIT = "oscar_export.kernels.decode_attention:_decode_split_kernel"
_MERGE = "oscar_export.kernels.decode_attention:_merge_kernel"
_TRT_SPLIT = "oscar_export.kernels.aot.trt_order:_decode_split_trt_kernel"
_TRT_MERGE = "oscar_export.kernels.aot.trt_order:_merge_trt_kernel"
#: BF16 tokens per sink/recent split (``decode_attention.BF16_CHUNK``; checked in the tests).
BF16_CHUNK = 64
#: splits the merge kernel combines per step (the wrapper's CH).
MERGE_CHUNK = 16
#: Triton's default num_stages (what the JIT uses when the wrapper passes none).
TRITON_DEFAULT_STAGES = 3
#: num_warps of the quant_pack wrapper's launch.
QUANT_WARPS = 4
#: ... and with the rotation fused in (``fused_rotation=True``).
QUANT_ROT_WARPS = 8


def layout_tag(layout: KVCacheLayout, num_heads: int) -> str:
    """Short variant tag, e.g. ``h9kv3d64p64s64w256_ktok``."""
    k = "kch" if layout.key.granularity == "channel" else "ktok"
    cb = "_cb" if (layout.key.codebook or layout.value.codebook) else ""
    return (f"h{num_heads}kv{layout.num_kv_heads}d{layout.head_dim}p{layout.page_size}"
            f"s{layout.sink}w{layout.window}_{k}{cb}")


def quant_pack_spec(layout: KVCacheLayout, fmt: RowFormat, which: str, rotate: bool, tag: str) -> KernelSpec:
    ptr = lambda n, t: Param(n, t)  # noqa: E731
    return KernelSpec(
        name=f"quant_pack_{which}{'_rot' if rotate else ''}_{tag}",
        kernel=_QP,
        params=(
            ptr("x_ptr", "*bf16"), ptr("page_ids_ptr", "*i32"), ptr("rank_ptr", "*i32"), ptr("levels_ptr", "*fp32"),
            ptr("rot_ptr", "*fp32"), ptr("dscale_ptr", "*fp32"), ptr("mean_ptr", "*fp32"),
            ptr("codes_ptr", "*u8"), ptr("params_ptr", "*fp16"),
            Param("stride_xn", "i32"), Param("stride_xh", "i32"), Param("stride_xp", "i32"),
        ),
        constexprs=tuple(sorted({
            "H_KV": layout.num_kv_heads, "P": layout.page_size, "D": layout.head_dim, "G": fmt.group_size,
            "CHANNEL": fmt.granularity == "channel", "ROTATE": rotate, "ROUND_BF16": rotate, "ROUND_FP16": False,
        }.items())),
        grid=("N", "H_KV", "1"),
        grid_inputs=("N",),
        num_warps=QUANT_ROT_WARPS if rotate else QUANT_WARPS,
        num_stages=TRITON_DEFAULT_STAGES,
        doc=f"quantize {'model-basis' if rotate else 'stored-basis'} {which.upper()} pages into the INT2 pool",
    )


def decode_split_spec(layout: KVCacheLayout, num_heads: int, sm_scale: float, tag: str) -> KernelSpec:
    hkv = layout.num_kv_heads
    if num_heads % hkv:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {hkv}")
    gq = num_heads // hkv
    codebook = bool(layout.key.codebook or layout.value.codebook)
    p = [("q_ptr", "*bf16"), ("rot_ptr", "*fp32"), ("dscale_ptr", "*fp32"),
         ("sink_k_ptr", "*bf16"), ("sink_v_ptr", "*bf16"), ("recent_k_ptr", "*bf16"), ("recent_v_ptr", "*bf16"),
         ("k_codes_ptr", "*u8"), ("k_params_ptr", "*fp16"), ("v_codes_ptr", "*u8"), ("v_params_ptr", "*fp16"),
         ("k_levels_ptr", "*fp32"), ("v_levels_ptr", "*fp32"), ("block_table_ptr", "*i32"),
         ("sink_len_ptr", "*i32"), ("num_pages_ptr", "*i32"), ("recent_len_ptr", "*i32"),
         ("part_o_ptr", "*fp32"), ("part_lse_ptr", "*fp32"),
         ("max_pages", "i32"), ("pages_per_split", "i32"), ("n_page_splits", "i32"), ("n_splits", "i32")]
    return KernelSpec(
        name=f"decode_split_{tag}",
        kernel=_SPLIT,
        params=tuple(Param(n, t) for n, t in p),
        constexprs=tuple(sorted({
            "H_KV": hkv, "GQ": gq, "GQ_PAD": gq_pad(gq), "D": layout.head_dim, "P": layout.page_size,
            "S0": layout.sink, "RC": layout.recent_slots, "BN": BF16_CHUNK, "SM_SCALE": float(sm_scale),
            "K_CHANNEL": layout.key.granularity == "channel", "K_CODEBOOK": codebook, "V_CODEBOOK": codebook,
            "ROTATE_Q": True, "FAST_UNPACK": not codebook,  # the wrapper's choice on a GPU
            "NB": PAGE_SLOTS,
        }.items())),
        grid=("B * H_KV", "n_splits", "1"),
        grid_inputs=("B",),
        num_warps=SPLIT_WARPS,
        num_stages=SPLIT_STAGES,
        doc="decode attention, one split of sink/INT2 pages/recent per program (query rotation fused)",
    )


def decode_merge_spec(layout: KVCacheLayout, tag: str) -> KernelSpec:
    return KernelSpec(
        name=f"decode_merge_{tag}",
        kernel=_MERGE,
        params=(Param("part_o_ptr", "*fp32"), Param("part_lse_ptr", "*fp32"), Param("out_ptr", "*bf16"),
                Param("n_splits", "i32")),
        constexprs=(("CH", MERGE_CHUNK), ("D", layout.head_dim)),
        grid=("rows", "1", "1"),
        grid_inputs=("rows",),
        num_warps=4,
        num_stages=TRITON_DEFAULT_STAGES,
        doc="merge decode splits by log-sum-exp; rows = B * H",
    )


def trt_specs(layout: KVCacheLayout, num_heads: int, sm_scale: float, tag: str) -> list[KernelSpec]:
    """The decode kernels in TensorRT's plugin order (same constexprs, warps and stages as the originals)."""
    split, merge = decode_split_spec(layout, num_heads, sm_scale, tag), decode_merge_spec(layout, tag)
    sp = {p.name: p for p in split.params}
    order = [p.name for p in split.params if p.name not in ("part_o_ptr", "part_lse_ptr")] + ["part_o_ptr", "part_lse_ptr"]
    mp = {p.name: p for p in merge.params}
    return [
        KernelSpec(name=f"trt_{split.name}", kernel=_TRT_SPLIT, params=tuple(sp[n] for n in order),
                   constexprs=split.constexprs, grid=split.grid, grid_inputs=split.grid_inputs,
                   num_warps=split.num_warps, num_stages=split.num_stages, doc=split.doc + " [TensorRT order]"),
        KernelSpec(name=f"trt_{merge.name}", kernel=_TRT_MERGE,
                   params=tuple(mp[n] for n in ("part_o_ptr", "part_lse_ptr", "n_splits", "out_ptr")),
                   constexprs=merge.constexprs, grid=merge.grid, grid_inputs=merge.grid_inputs,
                   num_warps=merge.num_warps, num_stages=merge.num_stages, doc=merge.doc + " [TensorRT order]"),
    ]


def serving_specs(layout: KVCacheLayout, num_heads: int, sm_scale: float, probes: bool = True,
                  trt: bool = True) -> list[KernelSpec]:
    """Every kernel variant serving ``layout`` needs (see the module doc)."""
    tag = layout_tag(layout, num_heads)
    specs = [
        quant_pack_spec(layout, layout.key, "k", False, tag),
        quant_pack_spec(layout, layout.key, "k", True, tag),
        quant_pack_spec(layout, layout.value, "v", False, tag),
        quant_pack_spec(layout, layout.value, "v", True, tag),
        decode_split_spec(layout, num_heads, sm_scale, tag),
        decode_merge_spec(layout, tag),
    ]
    if trt:
        specs += trt_specs(layout, num_heads, sm_scale, tag)
    if probes:
        specs += probe_specs(layout.head_dim, layout.value.group_size)
    return specs


@dataclass(frozen=True)
class DecodePlan:
    """Launch sizes of one decode step (what ``decode_attention`` computes on the host).

    Shapes: ``part_o [B, H, n_splits, D]`` fp32, ``part_lse [B, H, n_splits]`` fp32, ``out [B, H, D]``.
    """

    batch: int
    num_heads: int
    max_pages: int
    pages_per_split: int
    n_page_splits: int
    n_splits: int

    def split_args(self) -> dict[str, int]:
        return {"max_pages": self.max_pages, "pages_per_split": self.pages_per_split,
                "n_page_splits": self.n_page_splits, "n_splits": self.n_splits}


def decode_plan(layout: KVCacheLayout, batch: int, num_heads: int, max_pages: int, pages_per_split: int) -> DecodePlan:
    """The split arithmetic of ``decode_attention`` for a block table of ``max_pages`` columns."""
    if batch <= 0 or max_pages <= 0 or pages_per_split <= 0:
        raise ValueError(f"decode_plan: batch, max_pages, pages_per_split must be > 0, got {batch}, {max_pages}, "
                         f"{pages_per_split}")
    n_page = -(-max_pages // pages_per_split)
    n_bf16 = -(-layout.sink // BF16_CHUNK) + -(-layout.recent_slots // BF16_CHUNK)
    return DecodePlan(batch, num_heads, max_pages, pages_per_split, n_page, n_page + n_bf16)


__all__ = [
    "BF16_CHUNK", "DecodePlan", "decode_merge_spec", "decode_plan", "decode_split_spec", "layout_tag",
    "quant_pack_spec", "serving_specs", "trt_specs",
]
