"""The launch plan of every serving kernel, stated once (docs/design.md §3.5). No Triton, no torch.

For each kernel this module says: which ``@triton.jit`` function it is, its runtime parameters in launch
order with the pointer/scalar type the AOT bundle compiles, the names of its constexprs and how their values
follow from the layout, ``num_warps`` / ``num_stages``, the grid rule, the int32 arguments derived from
others, and where the shared memory comes from. Everyone that launches a kernel reads it:

* the JIT wrappers (``decode/portable.py``, ``decode/hopper.py``, ``decode_step.py``, ``quant_pack.py``) take their
  warp/stage and chunk constants from here (the module-level constants at their tops);
* the bundle (``bundle.py`` builds every ``KernelSpec`` from a plan; ``spec.py`` evaluates its rules,
  ``kernel_plan.py``);
* the driver-API launcher (``launcher.py``: ``block = 32 * num_warps`` of the compiled spec);
* ``trt_order.py`` (the TensorRT-order kernels: their parameters are :data:`TRT_DECODE_SPLIT` /
  :data:`TRT_DECODE_MERGE`), the TensorRT plugins (``plugins/trt``), the TensorRT-LLM device ops
  (``plugins/trtllm/device.py``) and the ONNX export (tensor names and dtypes of the plugin nodes).

``tests/kernels/test_aot_launch_plan.py`` checks every plan against the Triton function's ``arg_names`` and
records what the JIT wrappers actually launch (grid, argument order, warps, constexprs): a change of a kernel's
signature or of a wrapper's launch that is not made here fails there.

Shared memory: every kernel uses only the static/dynamic shared memory the compiler reports
(``metadata.shared``), recorded per binary in the manifest (``KernelEntry.shared``); launchers pass exactly that.
"""

from __future__ import annotations

from typing import Any

from .kernel_plan import TENSOR_NAMES, KernelPlan, tensor_name, trt_io  # what a plan is; read from here too

#: tokens per BF16 split of the sink / recent window (decode split kernel ``BN``).
BF16_CHUNK = 64
#: INT2 pages per loop iteration of the split kernel (``NB``; one page per warp, so it equals its warps).
PAGE_SLOTS = 2
#: splits the merge kernel combines per loop step (``CH``).
MERGE_CHUNK = 16
#: columns of the stored key row one decode-step writer program computes (``CB``, :func:`append_columns`): its
#: ``R_K[h][:, cols]`` is one load of ``D x CB`` fp32 (8 KB at D 128), read once for the key and the query
#: rotation; D / CB programs a (sequence, KV head) (8 at D 128).
APPEND_COLUMNS = 16
#: most fp32 elements of a writer program's query-rotation product ``[GQ_PAD, D, CB]`` (64 a thread at 4 warps).
APPEND_PRODUCT = 8192
#: Triton's default num_stages (what the JIT uses when a wrapper passes none).
TRITON_DEFAULT_STAGES = 3

_DA = "oscar_export.kernels.decode.portable"
_SPL = "oscar_export.kernels.decode.splits"
_DS = "oscar_export.kernels.decode_step"
_DAG = "oscar_export.kernels.decode.hopper_kernel"
_QP = "oscar_export.kernels.quant_pack"
_TRT = "oscar_export.kernels.aot.trt_order"


# ---- the plans ----------------------------------------------------------------------------------------------

#: the split kernels' inputs: ``q_ptr`` the step's fp32 queries in the stored key basis (the append launch's ``q_rot``;
#: the bundle's kernels rotate nothing, docs/design.md §3.6).
_SPLIT_INPUTS = (
    ("q_ptr", "*fp32"), ("sink_k_ptr", "*bf16"), ("sink_v_ptr", "*bf16"), ("recent_k_ptr", "*bf16"),
    ("recent_v_ptr", "*bf16"),
    ("k_codes_ptr", "*u8"), ("k_params_ptr", "*fp16"), ("v_codes_ptr", "*u8"), ("v_params_ptr", "*fp16"),
    ("k_levels_ptr", "*fp32"), ("v_levels_ptr", "*fp32"), ("block_table_ptr", "*i32"),
    ("sink_len_ptr", "*i32"), ("num_pages_ptr", "*i32"), ("recent_len_ptr", "*i32"),
)
_SPLIT_OUTPUTS = (("part_o_ptr", "*fp32"), ("part_lse_ptr", "*fp32"))
_SPLIT_SCALARS = (("max_pages", "i32"), ("pages_per_split", "i32"), ("n_page_splits", "i32"), ("n_splits", "i32"))
_SPLIT_CONSTEXPRS = ("H_KV", "GQ", "GQ_PAD", "D", "G", "P", "S0", "RC", "BN", "SM_SCALE", "K_CHANNEL", "K_CODEBOOK",
                     "V_CODEBOOK", "FAST_UNPACK", "NB", "KEY_BITS")
_SPLIT_DERIVED = (("n_page_splits", "cdiv(max_pages, pages_per_split)"),
                  ("n_splits", "n_page_splits + cdiv(S0, BN) + cdiv(RC, BN)"))

DECODE_SPLIT = KernelPlan(
    name="decode_split", kernel=f"{_DA}:decode_split_kernel",
    params=_SPLIT_INPUTS + _SPLIT_OUTPUTS + _SPLIT_SCALARS, constexprs=_SPLIT_CONSTEXPRS,
    num_warps=PAGE_SLOTS, num_stages=2, grid=("B * H_KV", "n_splits", "1"), sizes=("B",), derived=_SPLIT_DERIVED,
    doc="decode attention, one split of sink/INT2 pages/recent per program, over stored-basis fp32 queries",
)
#: cp.async page stages of the Gluon split kernel (``STAGES``: STAGES - 1 pages in flight while one is computed).
GL_PAGE_STAGES = 3
#: the Gluon split kernel's register cap per thread at head_dim <= 128: 4 CTAs (16 warps) share an SM's 64K
#: registers instead of 3 at the compiler's own 131-155 (P = D = 128: a few spill loads a page). With the wave
#: rule below, which counts those 4: 1.17-1.43x the portable kernel on the H200 (docs/kernels.md, launch
#: parameters). head_dim 256 keeps the compiler's 241-251 (2 CTAs): capped at 128 its page loop grows by 17 % and
#: that was never measured.
GL_MAXNREG = 128
#: fewest pages a Gluon split program streams (when the sequence has them): its cp.async stages overlap nothing
#: with one page (1x8K on the H200: 14.7 us at 1 page a split, 11.1-11.2 at 2-4).
GL_MIN_PAGES_PER_SPLIT = 4
#: a Gluon split program's fixed cost (query, block-table and first-page latency, its partial and the merge's
#: share), in page times: what :func:`gl_pages_per_split` adds to each program's pages.
GL_PROGRAM_PAGES = 2
#: the Gluon split kernel merges in its last programs (DECODE_SPLIT_MERGE_GL: one launch a decode attention). On
#: the H200 as fast or faster than the merge's own launch at every measured shape: 1x8K 9.9 vs 11.2 us, 1x32K 17.7
#: vs 19.5, within 1 % at 8x32K and 32x32K token keys (docs/kernels.md, launch parameters).
GL_FUSED_MERGE = True
DECODE_SPLIT_GL = KernelPlan(
    name="decode_split_gl", kernel=f"{_DAG}:_decode_split_gl_kernel",
    params=_SPLIT_INPUTS + _SPLIT_OUTPUTS + _SPLIT_SCALARS,
    constexprs=("H_KV", "GQ", "GQ_PAD", "D", "P", "S0", "RC", "BN", "SM_SCALE", "K_CHANNEL", "K_CODEBOOK", "V_CODEBOOK",
                "FAST_UNPACK", "STAGES", "KEY_BITS", "NG"),
    num_warps=4, num_stages=2, grid=("B * H_KV", "n_splits", "1"), sizes=("B",), derived=_SPLIT_DERIVED,
    doc="decode attention over mma16 pages (Gluon: codes unpacked into the wgmma A registers, one warpgroup, "
        "cp.async page stages); uniform codes, 2- or 4-bit key pages, sm_90 only; merged by decode_merge (bundles "
        "for sm_90: decode.select_backend)",
)
#: the Gluon split kernel with the merge in each (sequence, KV head)'s last program: one launch, no decode_merge.
DECODE_SPLIT_MERGE_GL = KernelPlan(
    name="decode_split_merge_gl", kernel=f"{_DAG}:_decode_split_merge_gl_kernel",
    params=_SPLIT_INPUTS + _SPLIT_OUTPUTS + (("out_ptr", "*bf16"), ("counters_ptr", "*i32")) + _SPLIT_SCALARS,
    constexprs=DECODE_SPLIT_GL.constexprs, num_warps=4, num_stages=2, grid=DECODE_SPLIT_GL.grid,
    sizes=DECODE_SPLIT_GL.sizes, derived=_SPLIT_DERIVED,
    doc="decode_split_gl whose last program of each (sequence, KV head) merges the splits (an int32 counter each, "
        "zero at launch and left zero); JIT only, not in bundles",
)
DECODE_MERGE = KernelPlan(
    name="decode_merge", kernel=f"{_SPL}:merge_kernel",
    params=(("part_o_ptr", "*fp32"), ("part_lse_ptr", "*fp32"), ("out_ptr", "*bf16"), ("n_splits", "i32")),
    constexprs=("D", "CH"), num_warps=4, num_stages=TRITON_DEFAULT_STAGES, grid=("rows", "1", "1"), sizes=("rows",),
    doc="merge decode splits by log-sum-exp; rows = B * H",
)
_QP_PARAMS = (
    ("x_ptr", "*bf16"), ("page_ids_ptr", "*i32"), ("rank_ptr", "*i32"), ("levels_ptr", "*fp32"),
    ("rot_ptr", "*fp32"), ("dscale_ptr", "*fp32"), ("mean_ptr", "*fp32"), ("codes_ptr", "*u8"),
    ("params_ptr", "*fp16"), ("stride_xn", "i32"), ("stride_xh", "i32"), ("stride_xp", "i32"),
)
_QP_CONSTEXPRS = ("H_KV", "P", "D", "G", "CHANNEL", "ROTATE", "ROUND_BF16", "ROUND_FP16", "PACKING", "BITS")
QUANT_PACK = KernelPlan(
    name="quant_pack", kernel=f"{_QP}:_quant_pack_kernel", params=_QP_PARAMS, constexprs=_QP_CONSTEXPRS,
    num_warps=4, num_stages=TRITON_DEFAULT_STAGES, grid=("N", "H_KV", "1"), sizes=("N",),
    doc="quantize stored-basis pages into the INT2 pool (prefill pages, demotion)",
)
QUANT_PACK_ROT = KernelPlan(
    name="quant_pack_rot", kernel=QUANT_PACK.kernel, params=_QP_PARAMS, constexprs=_QP_CONSTEXPRS,
    num_warps=8, num_stages=TRITON_DEFAULT_STAGES, grid=QUANT_PACK.grid, sizes=QUANT_PACK.sizes,
    doc="quantize model-basis pages into the INT2 pool, rotation fused",
)
DECODE_APPEND = KernelPlan(
    name="decode_append", kernel=f"{_DS}:_decode_append_kernel",
    params=(("k_ptr", "*bf16"), ("v_ptr", "*bf16"), ("q_ptr", "*bf16"), ("q_rot_ptr", "*fp32"),
            ("rot_ptr", "*fp32"), ("kscale_ptr", "*fp32"),
            ("kmean_ptr", "*fp32"), ("vmean_ptr", "*fp32"), ("sink_k_ptr", "*bf16"), ("sink_v_ptr", "*bf16"),
            ("recent_k_ptr", "*bf16"), ("recent_v_ptr", "*bf16"), ("k_codes_ptr", "*u8"), ("k_params_ptr", "*fp16"),
            ("v_codes_ptr", "*u8"), ("v_params_ptr", "*fp16"), ("k_rank_ptr", "*i32"), ("v_rank_ptr", "*i32"),
            ("k_levels_ptr", "*fp32"), ("v_levels_ptr", "*fp32"), ("block_table_ptr", "*i32"),
            ("sink_len_ptr", "*i32"), ("num_pages_ptr", "*i32"), ("recent_len_ptr", "*i32"), ("status_ptr", "*i32"),
            ("max_pages", "i32")),
    constexprs=("H_KV", "P", "D", "G", "S0", "C", "RCAP", "K_CHANNEL", "TRANSFORM", "CB", "NONFINITE", "K_PACKING",
                "V_PACKING", "K_BITS", "GQ", "ROTATE_Q"),
    num_warps=4, num_stages=TRITON_DEFAULT_STAGES, grid=("B", "H_KV", "D // CB"), sizes=("B",),
    doc="decode step: append one token per sequence into the recent ring (CB columns a program), demoting a page "
        "where the window is full (decided on the device; lengths are read, the page book commits them); with "
        "ROTATE_Q the step's queries rotated into the stored key basis (q_rot, fp32), once a step",
)
#: TensorRT's AOT-plugin order: input tensors, int32 extras, output tensors (``trt_order.py``).
TRT_DECODE_SPLIT = KernelPlan(
    name="trt_decode_split", kernel=f"{_TRT}:_decode_split_trt_kernel",
    params=_SPLIT_INPUTS + _SPLIT_SCALARS + _SPLIT_OUTPUTS, constexprs=_SPLIT_CONSTEXPRS,
    num_warps=DECODE_SPLIT.num_warps, num_stages=DECODE_SPLIT.num_stages, grid=DECODE_SPLIT.grid,
    sizes=DECODE_SPLIT.sizes, derived=_SPLIT_DERIVED, doc=DECODE_SPLIT.doc + " [TensorRT order]",
)
TRT_DECODE_MERGE = KernelPlan(
    name="trt_decode_merge", kernel=f"{_TRT}:_merge_trt_kernel",
    params=(("part_o_ptr", "*fp32"), ("part_lse_ptr", "*fp32"), ("n_splits", "i32"), ("out_ptr", "*bf16")),
    constexprs=DECODE_MERGE.constexprs, num_warps=DECODE_MERGE.num_warps, num_stages=DECODE_MERGE.num_stages,
    grid=DECODE_MERGE.grid, sizes=DECODE_MERGE.sizes, doc=DECODE_MERGE.doc + " [TensorRT order]",
)
PLANS = {p.name: p for p in (DECODE_SPLIT, DECODE_SPLIT_GL, DECODE_SPLIT_MERGE_GL, DECODE_MERGE,
                             QUANT_PACK, QUANT_PACK_ROT, DECODE_APPEND, TRT_DECODE_SPLIT, TRT_DECODE_MERGE)}


# ---- constexpr values (from the layout) ---------------------------------------------------------------------


def gq_pad_dot(gq: int) -> int:
    """Query heads per KV head padded for the portable split kernel's ``tl.dot`` s (their N, ``GQ_PAD``): a power of
    two, at least 4."""
    return max(4, 1 << max(0, (gq - 1).bit_length()))


def gq_pad_wgmma(gq: int) -> int:
    """Query heads per KV head padded for the hopper split kernel's warpgroup MMAs (their N, ``GQ_PAD``): a power of
    two, at least 8."""
    return max(8, 1 << max(0, (gq - 1).bit_length()))


def _split_shape(layout, num_heads: int) -> dict[str, Any]:
    """The arguments both split kernels' constexprs take from ``layout`` and ``num_heads``."""
    hkv = layout.num_kv_heads
    if num_heads % hkv:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {hkv}")
    return {"num_kv_heads": hkv, "gq": num_heads // hkv, "head_dim": layout.head_dim, "page_size": layout.page_size,
            "sink": layout.sink, "recent_slots": layout.recent_slots,
            "k_channel": layout.key.granularity == "channel", "key_bits": layout.key.bits}


def portable_split_constexprs(num_kv_heads: int, gq: int, head_dim: int, page_size: int, sink: int, recent_slots: int,
                              k_channel: bool, key_bits: int, *, group_size: int, sm_scale: float, codebook: bool,
                              fast_unpack: bool, page_slots: int = PAGE_SLOTS) -> dict[str, Any]:
    """Constexprs of the portable split kernel (``decode/portable.py``), from the layout's numbers as the JIT launch
    has them (queries in the stored key basis: no rotation in its programs). ``fast_unpack``: the PTX field
    extraction, the wrapper's choice (on a GPU; off under the CPU interpreter), never with fitted levels
    (``codebook``); ``page_slots``: the pages one loop iteration takes (``NB``, a tuning knob of the JIT wrapper)."""
    return {
        "H_KV": num_kv_heads, "GQ": gq, "GQ_PAD": gq_pad_dot(gq), "D": head_dim, "G": group_size, "P": page_size,
        "S0": sink, "RC": recent_slots, "BN": BF16_CHUNK, "SM_SCALE": float(sm_scale), "K_CHANNEL": bool(k_channel),
        "K_CODEBOOK": bool(codebook), "V_CODEBOOK": bool(codebook), "FAST_UNPACK": bool(fast_unpack and not codebook),
        "NB": page_slots, "KEY_BITS": key_bits,
    }


def decode_split_constexprs(layout, num_heads: int, sm_scale: float, fast_unpack: bool = True) -> dict[str, Any]:
    """:func:`portable_split_constexprs` for ``layout`` and ``num_heads`` query heads (what the bundle compiles;
    ``fast_unpack``: on, as on a GPU)."""
    return portable_split_constexprs(
        **_split_shape(layout, num_heads), group_size=layout.value.group_size, sm_scale=sm_scale,
        codebook=bool(layout.key.codebook or layout.value.codebook), fast_unpack=fast_unpack)


def gl_occupancy(head_dim: int) -> tuple[int, int]:
    """``(maxnreg, CTAs per SM)`` of the Gluon split kernel on sm_90: ``GL_MAXNREG`` and 4 at head_dim <= 128 (4 x
    128 threads x 128 registers = 64K; shared memory 4 x ~33 KB), the compiler's count (0) and 2 at 256."""
    return (GL_MAXNREG, 4) if head_dim <= 128 else (0, 2)


def gl_pages_per_split(batch: int, num_kv_heads: int, max_pages: int, num_sms: int, head_dim: int = 128) -> int:
    """Pages per split of the Gluon split kernel: the split count ``n`` (at most one per
    ``GL_MIN_PAGES_PER_SPLIT`` pages) that minimises ``waves(n) * (cdiv(max_pages, n) + GL_PROGRAM_PAGES)``,
    ``waves(n) = cdiv(B * H_kv * n, num_sms * CTAs per SM)`` (:func:`gl_occupancy`); the fewest splits on a tie.
    A partial last wave costs a whole program's time: on the H200, 1x128K took 52.0 us at 1.3 waves of 16-page
    programs and 47.7 at one wave of 24-page ones (3 CTAs an SM then; docs/kernels.md, launch parameters)."""
    if min(batch, num_kv_heads, max_pages, num_sms) <= 0:
        raise ValueError(f"gl_pages_per_split: expected positive sizes, got batch={batch}, "
                         f"num_kv_heads={num_kv_heads}, max_pages={max_pages}, num_sms={num_sms}")
    slots, programs = num_sms * gl_occupancy(head_dim)[1], batch * num_kv_heads

    def cost(n: int) -> int:
        return -(-programs * n // slots) * (-(-max_pages // n) + GL_PROGRAM_PAGES)

    best = min(range(1, -(-max_pages // GL_MIN_PAGES_PER_SPLIT) + 1), key=lambda n: (cost(n), n))
    return -(-max_pages // best)


def hopper_split_constexprs(num_kv_heads: int, gq: int, head_dim: int, page_size: int, sink: int, recent_slots: int,
                            k_channel: bool, key_bits: int, *, groups: int, sm_scale: float,
                            stages: int = GL_PAGE_STAGES) -> dict[str, Any]:
    """Constexprs of the hopper (Gluon) split kernel (``decode/hopper_kernel.py``; uniform codes only, its field
    masks always PTX), from the layout's numbers as the JIT launch has them: ``STAGES`` its cp.async page stages,
    ``KEY_BITS`` the key pages' code width (2 or 4), ``NG`` the token groups a row (``groups``: 1, or 2 at head_dim
    256)."""
    return {
        "H_KV": num_kv_heads, "GQ": gq, "GQ_PAD": gq_pad_wgmma(gq), "D": head_dim, "P": page_size, "S0": sink,
        "RC": recent_slots, "BN": BF16_CHUNK, "SM_SCALE": float(sm_scale), "K_CHANNEL": bool(k_channel),
        "K_CODEBOOK": False, "V_CODEBOOK": False, "FAST_UNPACK": True, "STAGES": int(stages), "KEY_BITS": key_bits,
        "NG": groups,
    }


def decode_split_gl_constexprs(layout, num_heads: int, sm_scale: float,
                               stages: int = GL_PAGE_STAGES) -> dict[str, Any]:
    """:func:`hopper_split_constexprs` for ``layout`` and ``num_heads`` query heads (what the bundle compiles)."""
    if layout.key.codebook or layout.value.codebook:
        raise NotImplementedError("decode_split_gl: uniform codes only (fitted levels: the portable kernel)")
    return hopper_split_constexprs(**_split_shape(layout, num_heads),
                                   groups=layout.head_dim // layout.value.group_size, sm_scale=sm_scale, stages=stages)


def decode_merge_constexprs(head_dim: int) -> dict[str, Any]:
    return {"D": head_dim, "CH": MERGE_CHUNK}


def quant_pack_constexprs(layout, fmt, rotate: bool, operand: str = "key",
                          round_to: str | None = "bfloat16") -> dict[str, Any]:
    """Constexprs of the quantizer writing ``fmt`` pages of ``layout``. ``rotate``: model-basis rows, the rotation
    fused (the bundle's ``_rot`` kernels); ``operand``: the pool written, ``"key"`` or ``"value"`` (it decides the
    mma16 order); ``round_to``: what the fused rotation's product is rounded through, ``"bfloat16"`` (as the
    bundle compiles), ``"float16"`` or None."""
    from ..layout import packing_code

    if round_to not in ("bfloat16", "float16", None):
        raise ValueError(f"round_to: expected 'bfloat16', 'float16' or None, got {round_to!r}")
    return {"H_KV": layout.num_kv_heads, "P": layout.page_size, "D": layout.head_dim, "G": fmt.group_size,
            "CHANNEL": fmt.granularity == "channel", "ROTATE": rotate, "ROUND_BF16": rotate and round_to == "bfloat16",
            "ROUND_FP16": rotate and round_to == "float16", "PACKING": packing_code(fmt, operand), "BITS": fmt.bits}


def append_columns(head_dim: int, gq: int = 1) -> int:
    """``CB`` of the decode-step writer: :data:`APPEND_COLUMNS`, halved while the query-rotation product of ``gq``
    query heads (padded to a power of two) would exceed :data:`APPEND_PRODUCT` elements (GQ 8 at D 128: 8)."""
    gq_pow2 = 1 << max(0, (gq - 1).bit_length())
    cb = min(APPEND_COLUMNS, head_dim)
    while cb > 1 and gq_pow2 * head_dim * cb > APPEND_PRODUCT:
        cb //= 2
    return cb


def append_constexprs(num_kv_heads: int, head_dim: int, group_size: int, page_size: int, sink: int,
                      recent_slots: int, recent_capacity: int, k_channel: bool, k_packing: int, v_packing: int,
                      key_bits: int, *, fused_transform: bool, gq: int, rotate_q: bool) -> dict[str, Any]:
    """Constexprs of the decode-step writer, from the layout's numbers as the JIT launch has them: ``C`` the ring's
    slots (``W + 2P``), ``RCAP`` the window's most recent tokens (``W + P``), ``K_PACKING`` / ``V_PACKING`` the pools'
    ``layout.packing_code``; ``fused_transform``: keys arrive in the model basis (see ``decode_step.py``); ``gq``
    query heads per KV head, rotated into the stored key basis by the same launch with ``rotate_q`` (``gq`` 1 and
    ``rotate_q`` False: no queries)."""
    from ..pages import STATUS_NONFINITE  # the status bit is stated by the page book

    return {"H_KV": num_kv_heads, "P": page_size, "D": head_dim, "G": group_size, "S0": sink, "C": recent_slots,
            "RCAP": recent_capacity, "K_CHANNEL": bool(k_channel), "TRANSFORM": bool(fused_transform),
            "CB": append_columns(head_dim, gq), "NONFINITE": STATUS_NONFINITE, "K_PACKING": k_packing,
            "V_PACKING": v_packing, "K_BITS": key_bits, "GQ": gq, "ROTATE_Q": bool(rotate_q)}


def decode_append_constexprs(layout, fused_transform: bool = False, num_heads: int | None = None) -> dict[str, Any]:
    """:func:`append_constexprs` for ``layout``; ``num_heads``: the launch also rotates the step's ``num_heads``
    queries (``ROTATE_Q``), None: it does not."""
    if num_heads is not None and (num_heads % layout.num_kv_heads or num_heads < layout.num_kv_heads):
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {layout.num_kv_heads}")
    from ..layout import packing_code

    return append_constexprs(
        layout.num_kv_heads, layout.head_dim, layout.value.group_size, layout.page_size, layout.sink,
        layout.recent_slots, layout.recent_capacity, layout.key.granularity == "channel",
        packing_code(layout.key, "key"), packing_code(layout.value, "value"), layout.key.bits,
        fused_transform=fused_transform, gq=1 if num_heads is None else num_heads // layout.num_kv_heads,
        rotate_q=num_heads is not None)


__all__ = [
    "APPEND_COLUMNS", "APPEND_PRODUCT", "BF16_CHUNK", "DECODE_APPEND", "DECODE_MERGE", "DECODE_SPLIT",
    "DECODE_SPLIT_GL", "DECODE_SPLIT_MERGE_GL", "GL_FUSED_MERGE", "GL_MAXNREG", "GL_MIN_PAGES_PER_SPLIT",
    "GL_PAGE_STAGES", "GL_PROGRAM_PAGES", "KernelPlan", "MERGE_CHUNK", "PAGE_SLOTS", "PLANS", "QUANT_PACK",
    "QUANT_PACK_ROT", "TENSOR_NAMES", "TRITON_DEFAULT_STAGES", "TRT_DECODE_MERGE", "TRT_DECODE_SPLIT",
    "append_columns", "append_constexprs", "decode_append_constexprs", "decode_merge_constexprs",
    "decode_split_constexprs", "decode_split_gl_constexprs", "gl_occupancy", "gl_pages_per_split",
    "gq_pad_dot", "gq_pad_wgmma", "hopper_split_constexprs", "portable_split_constexprs",
    "quant_pack_constexprs", "tensor_name", "trt_io"
]
