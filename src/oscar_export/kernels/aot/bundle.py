"""Which serving kernels go into a model's bundle, and the host-side launch plan a plugin follows.

A bundle is compiled for one model shape and one artifact layout (every constexpr fixed: head counts,
head_dim, page size, windows, row formats, softmax scale). For that layout it holds:

* ``quant_pack_{k,v}[_rot]`` — ``kernels/quant_pack.py:_quant_pack_kernel``: demotion (rows already in the
  stored basis) and, with ``_rot``, prefill pages straight from model-basis rows (``(x R) d - mu`` rounded
  through BF16, as the wrapper does). Grid ``(N pages, H_kv)``.
* ``decode_split`` — ``kernels/decode/portable.py:decode_split_kernel`` (``decode/hopper_kernel.py``'s for mma16
  pages) over the step's fp32 queries in the stored key basis, ``decode_append``'s ``q_rot``: no split program
  rotates a query. Grid ``(B * H_kv, n_splits)``.
* ``decode_merge`` — ``kernels/decode/splits.py:merge_kernel``, BF16 output. Grid ``(B * H,)``.
* ``decode_append`` — ``kernels/decode_step.py:_decode_append_kernel``: the decode step's cache write on the
  device (the token into the recent ring, a demotion decided by the kernel from the committed lengths; keys
  and values already in the stored basis, ``TRANSFORM`` off), and the step's ``H`` queries rotated into the stored
  key basis, once a step (``ROTATE_Q``: model-basis BF16 ``q`` in, fp32 ``q_rot [B, H, D]`` out, what the split
  kernel reads). Grid ``(B, H_kv, D // CB)`` (``launch_plan.append_columns`` of ``GQ = H / H_kv``).
* ``trt_decode_split`` / ``trt_decode_merge`` — the same two kernels in TensorRT's AOT-plugin parameter
  order (``trt_order.py``: inputs, int32 extras, outputs) for ``plugins/trt``.
* the two probe kernels (``probe.py``) as a self-test.

Layers with 4-bit keys (``layout.with_key_bits(4)``) need their own variants of every kernel (the key pool and
the constexprs differ): :func:`layout_tag` gives them the suffix ``_k4``, and ``serving_specs(..., key_bits=(2,
4))`` builds both sets; the manifest records the widths (``manifest.key_bits``).

Parameters, constexprs, warps, stages and grid rules come from ``launch_plan.py`` (the one statement of them,
which the JIT wrappers read too), so the AOT binaries compute what the JIT launches compute, bit for bit.
:func:`decode_plan` evaluates the split kernel's derived int32 arguments for a host that launches the binaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..layout import KVCacheLayout, RowFormat
from . import launch_plan as lp
from .probe import probe_specs
from .spec import KernelSpec


def layout_tag(layout: KVCacheLayout, num_heads: int) -> str:
    """Short variant tag, e.g. ``h9kv3d64p64s64w256_ktok``; ``g128`` after ``d`` when groups are shorter than a
    row (``h16kv8d256g128p128s64w256_ktok``, Gemma 3); ``_k4`` after the key granularity for 4-bit keys
    (``h32kv8d128p128s64w256_ktok_k4``)."""
    k = "kch" if layout.key.granularity == "channel" else "ktok"
    k += "" if layout.key.bits == 2 else f"_k{layout.key.bits}"
    cb = "_cb" if (layout.key.codebook or layout.value.codebook) else ""
    g = "" if layout.value.group_size == layout.head_dim else f"g{layout.value.group_size}"
    pk = {"linear": "", "mma16": "_mma16"}.get(layout.packing, f"_k{layout.key.packing}v{layout.value.packing}")
    return (f"h{num_heads}kv{layout.num_kv_heads}d{layout.head_dim}{g}p{layout.page_size}"
            f"s{layout.sink}w{layout.window}_{k}{cb}{pk}")


def quant_pack_spec(layout: KVCacheLayout, fmt: RowFormat, which: str, rotate: bool, tag: str) -> KernelSpec:
    plan = lp.QUANT_PACK_ROT if rotate else lp.QUANT_PACK
    spec = KernelSpec.from_plan(plan, f"quant_pack_{which}{'_rot' if rotate else ''}_{tag}",
                                lp.quant_pack_constexprs(layout, fmt, rotate, "key" if which == "k" else "value"))
    return spec


def decode_split_spec(layout: KVCacheLayout, num_heads: int, sm_scale: float, tag: str) -> KernelSpec:
    """The split kernel of the layout's page packing (what ``decode.select_backend`` chose for the target): the
    hopper (Gluon) kernel for mma16 pages (``decode/hopper_kernel.py``; sm_90 only, uniform codes; its driver-API
    launch run on the H200: tests/gpu/test_aot_gpu.py::test_gluon_decode_bundle_equals_jit), the portable kernel
    (``decode/portable.py``) for linear pages."""
    if layout.packing == "mma16":
        return KernelSpec.from_plan(lp.DECODE_SPLIT_GL, f"decode_split_{tag}",
                                    lp.decode_split_gl_constexprs(layout, num_heads, sm_scale),
                                    maxnreg=lp.gl_occupancy(layout.head_dim)[0])
    if layout.packing == "linear":
        return KernelSpec.from_plan(lp.DECODE_SPLIT, f"decode_split_{tag}",
                                    lp.decode_split_constexprs(layout, num_heads, sm_scale))
    raise NotImplementedError(f"decode_split: keys packed {layout.key.packing!r}, values {layout.value.packing!r}; "
                              "both linear or both mma16 are supported")


def serving_layout(layout: KVCacheLayout, archs: Sequence[str | int], num_heads: int,
                   key_bits: Sequence[int] | None = None, linear: bool = False) -> KVCacheLayout:
    """``layout`` with the page packing a bundle for ``archs`` serves: what ``decode.select_backend`` picks for a
    single target arch, for every key width the layers use (mma16 on sm_90 where the hopper kernel reads them all);
    linear pages (the portable kernel, every arch) for several archs, ``linear=True`` (the TensorRT plugins) or
    widths the targets' backends disagree on."""
    from ..decode.backend import backends_by_width
    from .manifest import parse_arch

    lin = layout.with_packing("linear")
    caps = sorted({parse_arch(a) for a in archs})
    if linear or len(caps) != 1:
        return lin
    chosen = backends_by_width(lin, key_bits or (layout.key.bits,), caps[0], num_heads)
    packings = {backend.packing for backend in chosen.values()}
    return lin.with_packing(packings.pop()) if len(packings) == 1 else lin


def decode_merge_spec(layout: KVCacheLayout, tag: str) -> KernelSpec:
    return KernelSpec.from_plan(lp.DECODE_MERGE, f"decode_merge_{tag}", lp.decode_merge_constexprs(layout.head_dim))


def decode_step_specs(layout: KVCacheLayout, num_heads: int, tag: str) -> list[KernelSpec]:
    """The decode step's cache write (``decode_step.py``): token + demotion where due and the step's ``num_heads``
    queries rotated into the stored key basis, one launch."""
    return [KernelSpec.from_plan(lp.DECODE_APPEND, f"decode_append_{tag}",
                                 lp.decode_append_constexprs(layout, num_heads=num_heads))]


def trt_specs(layout: KVCacheLayout, num_heads: int, sm_scale: float, tag: str) -> list[KernelSpec]:
    """The decode kernels in TensorRT's plugin order (same constexprs, warps and stages as the originals).
    Linear pages only: there is no TensorRT-order mma16 kernel yet."""
    if layout.packing != "linear":
        raise NotImplementedError(f"trt_specs: TensorRT-order kernels exist for linear pages only, got "
                                  f"{layout.packing!r}")
    return [
        KernelSpec.from_plan(lp.TRT_DECODE_SPLIT, f"trt_decode_split_{tag}",
                             lp.decode_split_constexprs(layout, num_heads, sm_scale)),
        KernelSpec.from_plan(lp.TRT_DECODE_MERGE, f"trt_decode_merge_{tag}",
                             lp.decode_merge_constexprs(layout.head_dim)),
    ]


def serving_specs(layout: KVCacheLayout, num_heads: int, sm_scale: float, probes: bool = True,
                  trt: bool = True, key_bits: Sequence[int] | None = None) -> list[KernelSpec]:
    """Every kernel variant serving ``layout`` needs (see the module doc). ``trt``: the TensorRT-order decode
    kernels, built for linear pages only (an mma16 bundle has none: the TensorRT plugin refuses it on load).
    ``key_bits``: the key code widths of the model's layers (``(2, 4)`` when some layers have 4-bit keys): one
    set of variants per width, for ``layout.with_key_bits(b)``; default ``layout.key.bits`` alone. The layout's
    packing picks the split kernel (:func:`serving_layout` gives the one a target serves)."""
    widths = (layout.key.bits,) if key_bits is None else tuple(sorted(set(key_bits)))
    if not widths:
        raise ValueError("serving_specs: key_bits must name at least one code width")
    specs = []
    for bits in widths:
        lay = layout.with_key_bits(bits)
        tag = layout_tag(lay, num_heads)
        specs += [
            quant_pack_spec(lay, lay.key, "k", False, tag),
            quant_pack_spec(lay, lay.key, "k", True, tag),
            quant_pack_spec(lay, lay.value, "v", False, tag),
            quant_pack_spec(lay, lay.value, "v", True, tag),
            decode_split_spec(lay, num_heads, sm_scale, tag),
            decode_merge_spec(lay, tag),
            *decode_step_specs(lay, num_heads, tag),
        ]
        if trt and lay.packing == "linear":
            specs += trt_specs(lay, num_heads, sm_scale, tag)
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
    """The split kernel's int32 arguments (``launch_plan.DECODE_SPLIT.derived``) for a block table of
    ``max_pages`` columns."""
    if batch <= 0 or max_pages <= 0 or pages_per_split <= 0:
        raise ValueError(f"decode_plan: batch, max_pages, pages_per_split must be > 0, got {batch}, {max_pages}, "
                         f"{pages_per_split}")
    cx = lp.decode_split_constexprs(layout, num_heads, 1.0)
    a = lp.DECODE_SPLIT.scalars({"max_pages": max_pages, "pages_per_split": pages_per_split}, cx)
    return DecodePlan(batch, num_heads, a["max_pages"], a["pages_per_split"], a["n_page_splits"], a["n_splits"])


__all__ = [
    "DecodePlan", "decode_merge_spec", "decode_plan", "decode_split_spec",
    "decode_step_specs", "layout_tag",
    "quant_pack_spec", "serving_layout", "serving_specs", "trt_specs",
]
