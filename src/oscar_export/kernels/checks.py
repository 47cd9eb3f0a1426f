"""The input checks of the Triton kernels' wrappers, each stated once. Imports torch, never Triton.

Every wrapper (``quant_pack.py``, ``decode_step.py``, ``decode/portable.py``, ``decode/hopper.py``, the custom ops of
``triton_ops.py``) validates its inputs here before it allocates or launches; the Hugging Face cache runs them when a
cache is made (``plugins/hf``), and ``decode.select_backend`` asks :func:`check_hopper_layout` which backend reads a
layout. Each raises with the name of the input, what was expected and what came: ``ValueError`` / ``TypeError`` for a
wrong input, ``NotImplementedError`` for a valid layout a kernel does not handle.

==================================  ==================================================================================
check                               what it refuses
==================================  ==================================================================================
:func:`check_tensor`                a tensor of the wrong shape, dtype or device (or not contiguous, when asked)
:func:`check_format`                row formats the Triton kernels do not handle (quantizer, writer, portable decode)
:func:`check_paged_state`           a paged cache whose buffers do not have the layout's shapes and dtypes
:func:`check_decode_inputs`         decode-attention inputs, whichever kernel reads the pages
:func:`check_portable_layout`       layouts the portable decode kernel does not read (linear pages)
:func:`check_hopper_layout`         layouts the hopper (Gluon) decode kernel does not read (mma16 pages)
:func:`check_hopper_device`         a device that is not a Hopper GPU
:func:`check_hopper_state`          page pools not 16-byte aligned (the hopper kernel's cp.async)
:func:`check_decode_append_inputs`  decode-step write inputs (``decode_step.decode_append``)
==================================  ==================================================================================
"""

from __future__ import annotations

import math

import torch

from .layout import KVCacheLayout, PagedKV, RowFormat
from .transform import LayerTransform

#: dtypes the wrappers take for BF16-window inputs (queries, keys, values) and give back (decode outputs).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: head_dim, page size and key code widths the hopper (Gluon) kernel is built for.
HOPPER_HEAD_DIMS = (64, 128, 256)
HOPPER_PAGE_SIZES = (64, 128)
HOPPER_KEY_BITS = (2, 4)
#: GQA ratios (query heads per KV head) the hopper kernel is built for (the warpgroup MMA's N, padded: 8 or 16).
HOPPER_GQ = (1, 2, 3, 4, 5, 6, 7, 8, 16)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | tuple, device,
                 contiguous: bool = False) -> None:
    """Raise unless ``t`` is a tensor of ``shape``, of ``dtype`` (one of them, for a tuple), on ``device`` and, with
    ``contiguous``, contiguous."""
    dts = dtype if isinstance(dtype, tuple) else (dtype,)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dts:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dts))}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def check_format(fmt: RowFormat, page_size: int, what: str) -> None:
    """Raise ``NotImplementedError`` for row formats the Triton quantizer does not handle."""
    if not (_pow2(fmt.head_dim) and _pow2(fmt.group_size) and _pow2(page_size)):
        raise NotImplementedError(
            f"{what}: the Triton kernels need power-of-two head_dim, group_size and page_size, got "
            f"{fmt.head_dim}, {fmt.group_size}, {page_size}"
        )
    if fmt.head_dim > 256 or page_size > 256:
        raise NotImplementedError(f"{what}: head_dim and page_size <= 256 supported, got {fmt.head_dim}, {page_size}")
    if fmt.packing == "mma16" and fmt.head_dim < 64:
        raise NotImplementedError(f"{what}: the Triton kernels write 'mma16' pages for head_dim >= 64, "
                                  f"got {fmt.head_dim}")
    if fmt.bits not in (2, 4):
        raise NotImplementedError(f"{what}: the Triton kernels write 2- and 4-bit codes, got {fmt.bits}-bit")


def check_paged_state(state: PagedKV, layout: KVCacheLayout, batch: int, device) -> None:
    """Raise unless every buffer of ``state`` has the layout's shape and dtype for ``batch`` sequences, lives
    on ``device`` and is contiguous (the pool size and block-table width are taken from the state)."""
    pool = state.k_codes.shape[0]
    max_pages = state.block_table.shape[1] if state.block_table.dim() == 2 else -1
    for name, t, shape, dt in (
        ("state.sink_k", state.sink_k, layout.sink_shape(batch), torch.bfloat16),
        ("state.sink_v", state.sink_v, layout.sink_shape(batch), torch.bfloat16),
        ("state.recent_k", state.recent_k, layout.recent_shape(batch), torch.bfloat16),
        ("state.recent_v", state.recent_v, layout.recent_shape(batch), torch.bfloat16),
        ("state.k_codes", state.k_codes, layout.key_codes_shape(pool), torch.uint8),
        ("state.v_codes", state.v_codes, layout.value_codes_shape(pool), torch.uint8),
        ("state.k_params", state.k_params, layout.key_params_shape(pool), torch.float16),
        ("state.v_params", state.v_params, layout.value_params_shape(pool), torch.float16),
        ("state.block_table", state.block_table, (batch, max_pages), torch.int32),
        ("state.sink_len", state.sink_len, (batch,), torch.int32),
        ("state.num_pages", state.num_pages, (batch,), torch.int32),
        ("state.recent_len", state.recent_len, (batch,), torch.int32),
    ):
        check_tensor(name, t, shape, dt, device, contiguous=True)


# ---- decode attention ---------------------------------------------------------------------------------------


def check_decode_inputs(
    q: torch.Tensor, state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor,
    scale: float, out_dtype: torch.dtype, pages_per_split: int | None = None,
) -> None:
    """Raise on decode-attention inputs no kernel can launch on, whatever the page packing (the kernel's own layout
    check is :func:`check_portable_layout` or :func:`check_hopper_layout`). Reads shapes only, never device values.

    Args:
        q: ``[B, H, D]`` float32/bf16/fp16, contiguous, ``H`` a multiple of ``layout.num_kv_heads``.
        state: the layer's cache (:func:`check_paged_state`); k_levels, v_levels: ``[H_kv, 4]`` fp32, contiguous.
        scale: a positive finite Python float; out_dtype: float32, bf16 or fp16; pages_per_split: None or > 0.
    """
    if q.dim() != 3:
        raise ValueError(f"q: expected [B, H, D], got {list(q.shape)}")
    bsz, hq, d = q.shape
    hkv = layout.num_kv_heads
    if d != layout.head_dim:
        raise ValueError(f"q: expected head_dim {layout.head_dim}, got {d}")
    if hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of {hkv} KV heads")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q: expected float32, bfloat16 or float16, got {q.dtype}")
    if not q.is_contiguous():
        raise ValueError("q: expected a contiguous tensor")
    check_paged_state(state, layout, bsz, q.device)
    for name, t in (("k_levels", k_levels), ("v_levels", v_levels)):
        check_tensor(name, t, (hkv, 4), torch.float32, q.device, contiguous=True)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected float32, bfloat16 or float16, got {out_dtype}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite Python float, got {scale!r}")
    if pages_per_split is not None and pages_per_split <= 0:
        raise ValueError(f"pages_per_split: expected > 0, got {pages_per_split}")


def check_portable_layout(layout: KVCacheLayout) -> None:
    """Raise for layouts the portable decode kernel (``decode/portable.py``) does not read: pages not linear
    (``ValueError``); ``NotImplementedError`` for wider values, a head_dim other than 64, 128 or 256, a row format
    :func:`check_format` refuses, or groups smaller than a row (``G < D``) below 64 (a group's 16 code bytes per
    field feed a dot) or not the same for keys and values."""
    d = layout.head_dim
    if layout.value.bits != 2:
        raise NotImplementedError(f"decode_attention: values are 2-bit (only keys may be wider), got "
                                  f"{layout.value.bits}-bit")
    if layout.packing != "linear":  # mma16 pages: the hopper backend (decode/hopper.py)
        raise ValueError(f"decode_attention (portable): reads 'linear' pages, the layout's are {layout.packing!r} "
                         f"(mma16 pages: the hopper backend)")
    if d not in (64, 128, 256):
        raise NotImplementedError(f"decode_attention: head_dim 64, 128 or 256 supported, got {d}")
    for name, fmt in (("key", layout.key), ("value", layout.value)):
        check_format(fmt, layout.page_size, f"decode_attention {name}")
        if fmt.group_size != d and fmt.group_size < 64:
            raise NotImplementedError(
                f"decode_attention: {name} group_size must equal head_dim ({d}) or be >= 64, got {fmt.group_size}"
            )
    if layout.key.group_size != layout.value.group_size:
        raise NotImplementedError(
            f"decode_attention: key and value group sizes must match, got {layout.key.group_size} and "
            f"{layout.value.group_size}"
        )


def check_hopper_layout(layout: KVCacheLayout, num_heads: int) -> None:
    """Raise for what the hopper (Gluon) decode kernel does not read: pages not mma16 (``ValueError``), and
    ``NotImplementedError`` for key codes it does not hold, a head_dim / page size / GQA ratio it is not built for,
    token groups smaller than a row (but two groups of 128 at head_dim 256: Gemma 3, run on the H200 2026-12-02) or
    fitted (codebook) levels. Whether this Triton has Gluon is the wrapper's question (``decode/hopper.py``)."""
    if layout.key.packing != "mma16" or layout.value.packing != "mma16":
        raise ValueError(f"hopper decode: reads 'mma16' pages, the layout has key {layout.key.packing!r}, value "
                         f"{layout.value.packing!r} (linear pages: the portable kernel)")
    if layout.key.bits not in HOPPER_KEY_BITS or layout.value.bits != 2:
        raise NotImplementedError(f"hopper decode: reads {list(HOPPER_KEY_BITS)}-bit key and 2-bit value pages, the "
                                  f"layout has {layout.key.bits}-bit keys and {layout.value.bits}-bit values")
    if num_heads % layout.num_kv_heads or num_heads // layout.num_kv_heads not in HOPPER_GQ:
        raise NotImplementedError(f"hopper decode: {num_heads} query heads over {layout.num_kv_heads} KV heads; GQA "
                                  f"ratios {list(HOPPER_GQ)} supported")
    if layout.key.codebook or layout.value.codebook:
        raise NotImplementedError("hopper decode: fitted (codebook) levels are not supported; the portable "
                                  "backend reads them")
    if layout.head_dim not in HOPPER_HEAD_DIMS:
        raise NotImplementedError(f"hopper decode: head_dim {list(HOPPER_HEAD_DIMS)} supported, got {layout.head_dim}")
    if layout.page_size not in HOPPER_PAGE_SIZES:
        raise NotImplementedError(f"hopper decode: page_size {list(HOPPER_PAGE_SIZES)} supported, "
                                  f"got {layout.page_size}")
    for name, fmt in (("key", layout.key), ("value", layout.value)):
        if fmt.granularity == "token" and fmt.group_size != layout.head_dim and (layout.head_dim, fmt.group_size) != (
                256, 128):
            raise NotImplementedError(f"hopper decode: {name} token groups of head_dim or, at head_dim 256, of "
                                      f"128, got {fmt.group_size} at {layout.head_dim}")
    if layout.key.granularity == "token" and layout.key.group_size != layout.value.group_size:
        raise NotImplementedError("hopper decode: key and value token groups must match")


def check_hopper_device(device: torch.device) -> None:
    """Raise ``NotImplementedError`` unless ``device`` is a Hopper GPU (sm_90: the warpgroup MMAs; neither Ampere /
    Ada nor Blackwell have them)."""
    if device.type != "cuda":
        raise NotImplementedError("hopper decode: CUDA only (Gluon has no CPU interpreter); "
                                  "the portable backend reads them")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) != (9, 0):
        raise NotImplementedError(f"hopper decode: warpgroup MMAs need a Hopper GPU (sm_90), this one is "
                                  f"sm_{cap[0]}{cap[1]}; the portable backend reads them")


def check_hopper_state(state: PagedKV) -> None:
    """The hopper kernel copies pages 16 bytes at a time (cp.async): every page pool must start 16-byte aligned.
    Reads pointers: call it when the cache is made, not in a traced step."""
    for name in ("k_codes", "v_codes", "k_params", "v_params"):
        off = getattr(state, name).data_ptr() % 16
        if off:
            raise ValueError(f"state.{name}: the hopper kernel copies pages 16 bytes at a time; the buffer must start "
                             f"16-byte aligned, it starts {off} bytes past a boundary (a sliced view?)")


# ---- the decode step's cache write --------------------------------------------------------------------------


def check_decode_append_inputs(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, q: torch.Tensor | None = None,
) -> None:
    """Raise on anything ``decode_step.decode_append`` cannot launch on (shapes, dtypes, devices only)."""
    h, d, p = layout.num_kv_heads, layout.head_dim, layout.page_size
    check_format(layout.key, p, "decode_append key")
    check_format(layout.value, p, "decode_append value")
    if layout.value.bits != 2:
        raise NotImplementedError(f"decode_append: values are 2-bit (only keys may be wider), got {layout.value.bits}")
    if layout.window % p:
        raise NotImplementedError(f"decode_append: the window ({layout.window}) must be a multiple of P={p}")
    if k.dim() != 3:
        raise ValueError(f"k: expected [B, H_kv, D], got {list(k.shape)}")
    bsz = k.shape[0]
    dev = k.device
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, (bsz, h, d), FLOAT_DTYPES, dev, contiguous=True)
    check_tensor("status", status, (bsz,), torch.int32, dev)
    if q is not None:
        if q.dim() != 3 or q.shape[0] != bsz or q.shape[1] % h or q.shape[2] != d or not 0 < q.shape[1] // h <= 64:
            raise ValueError(f"q: expected [{bsz}, H_kv * GQ (GQ <= 64), {d}] with H_kv={h}, got {list(q.shape)}")
        check_tensor("q", q, tuple(q.shape), FLOAT_DTYPES, dev, contiguous=True)
    check_paged_state(state, layout, bsz, dev)
    tr = transform
    for name, t, shape in (("k_clip", tr.k_clip, (h,)), ("v_clip", tr.v_clip, (h,)),
                           ("k_levels", tr.k_levels, (h, 4)), ("v_levels", tr.v_levels, (h, 4)),
                           ("k_rotation", tr.k_rotation, (h, d, d)), ("k_scale", tr.k_scale, (h, d)),
                           ("k_mean", tr.k_mean, (h, d)), ("v_mean", tr.v_mean, (h, d))):
        check_tensor(f"transform.{name}", t, shape, torch.float32, dev, contiguous=True)
    if layout.key.granularity == "token" and layout.key.group_size != layout.value.group_size:
        raise NotImplementedError("decode_append: key and value token group sizes must match")


__all__ = [
    "FLOAT_DTYPES", "HOPPER_GQ", "HOPPER_HEAD_DIMS", "HOPPER_KEY_BITS", "HOPPER_PAGE_SIZES",
    "check_decode_append_inputs", "check_decode_inputs", "check_format", "check_hopper_device", "check_hopper_layout",
    "check_hopper_state", "check_paged_state", "check_portable_layout", "check_tensor",
]
