"""Fused (rotate,) clip, quantize and pack of whole pages: the Triton twin of ``reference.quantize_pages``.

One program quantizes one page of one KV head (``[P, D]`` rows) and writes its packed codes and fp16
``(scale, lo)`` params straight into the page pool. It serves the prefill write (whole pages known up front)
and the demotion of the oldest recent tokens inside a decode step (:mod:`.decode_step`).

The arithmetic is the reference's, step for step (see ``kernels/reference/``): the clip threshold is
``sorted(|x|)[rank]`` of the group, i.e. its K-th largest ``|x|`` with ``K = group - rank``, found with
per-thread top-8 lists in registers (:mod:`.clip_threshold`); the scale is
``fp16((hi - lo) * fp32(1/3))`` and the codes compare ``x - lo`` with ``t_j * s``. There is no division,
so the codes and params are bit-identical to the reference on the same stored-basis input. A page takes
two passes over its rows: the threshold (with min/max), then the codes.

4-bit pages (``RowFormat.bits == 4``, constexpr ``BITS``; keys of the layers that have them) take the same
threshold pass; the scale uses ``reference.span_inverse(16)`` and the code compares with the 15 uniform
midpoints. The code pass still loads the four quarters of a group: a 4-bit byte of ``reference.pack_codes``
holds quarters 0 and 2 (bytes ``0 .. G/4``) or 1 and 3 (bytes ``G/4 .. G/2``) of the same position.

Rows given in the model basis (``rotation``) are turned into ``x_s = (x @ R[h]) * d[h] - mu[h]`` by
``torch.matmul`` first, rounded to ``round_dtype`` (the BF16 the recent buffer would have held), exactly as
``LayerTransform.transform_keys`` does. ``fused_rotation=True`` does the product inside the kernel instead
(the AOT bundle's ``_rot`` kernel; one ``[P, D]`` tile, the threshold by one-at-a-time max removal): it sums
in a different order than ``torch.matmul``, so a value on a code boundary may flip, and it is ~10x slower
on the H200. Both are tested with a tolerance, the plain path bit-exactly.

Here: the kernel, its rotated-input tile and the wrappers. The passes over a page-head of stored-basis rows are
beside it: token groups in :mod:`.quant_token`, channel groups in :mod:`.quant_channel`, the codes and their mma16
store in :mod:`.quant_codes`, the clip threshold in :mod:`.clip_threshold`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import launch_plan as _plan
from .cache_keys import hash_bottom_up
from .checks import check_format, check_tensor
from .layout import KVCacheLayout, RowFormat, packing_code
from .quant_channel import channel_pages
from .quant_codes import ONE_FIFTEENTH, ONE_THIRD, code4bit, store_codes_mma16
from .quant_token import token_pages
from .transform import clip_rank

#: rows of R per step of the fused rotation when ``D > 128`` (the whole fp32 ``[D, D]`` exceeds shared memory).
ROT_K = tl.constexpr(32)

# ---- kernel -------------------------------------------------------------------------------------------------


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest BF16 value (ties to even), still as fp32; a cast of it to BF16 is then exact.

    Done on the bits because Triton's CPU interpreter (3.9) truncates ``.to(tl.bfloat16)`` while the GPU
    rounds to nearest even; this way both give torch's ``x.to(torch.bfloat16)``. Inputs are finite.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def quantize_page(x_base, stride_xp, codes_ptr, params_ptr, page_head, removals, lv0, lv1, lv2, lv3,
                   P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, CHANNEL: tl.constexpr,
                   PACKING: tl.constexpr = 0, BITS: tl.constexpr = 2):
    """Quantize the rows ``[P, D]`` at ``x_base`` (row stride ``stride_xp``) into page-head ``page_head`` (int64);
    ``PACKING``: ``layout.packing_code`` of the pool; ``BITS``: its code width (2, or 4: uniform levels)."""
    codes_base = codes_ptr + page_head * (P * D * BITS // 8)
    if CHANNEL:
        channel_pages(x_base, stride_xp, codes_base, params_ptr + page_head * (2 * D), removals + 1,
                       lv0, lv1, lv2, lv3, P, D, G, PACKING, BITS)
    else:
        token_pages(x_base, stride_xp, codes_base, params_ptr + page_head * (P * (D // G) * 2), removals + 1,
                     lv0, lv1, lv2, lv3, P, D, G, PACKING, BITS)


# ---- the rotated-input path: the whole page as one tile (the basis change needs full rows) -------------------


@triton.jit
def _clip_quantize(a, x, rank_removals, lv0, lv1, lv2, lv3, N: tl.constexpr, BITS: tl.constexpr = 2):
    """Quantize the groups laid along axis 1 of ``x [R, N]`` (``a = |x|``); the threshold by removing the
    current max one occurrence (lowest index) at a time. Returns codes int32, scale16 ``[R]``, lo16 ``[R]``
    (``BITS == 4``: 16 uniform levels, ``lv*`` unused).
    """
    col = tl.arange(0, N)[None, :]
    for _ in range(rank_removals):
        m = tl.max(a, axis=1)
        idx = tl.min(tl.where(a == m[:, None], col, N), axis=1)
        a = tl.where(col == idx[:, None], -1.0, a)
    thr = tl.max(a, axis=1)[:, None]
    xc = tl.minimum(tl.maximum(x, -thr), thr)
    lo = tl.min(xc, axis=1)
    hi = tl.max(xc, axis=1)
    if BITS == 4:
        scale16 = ((hi - lo) * ONE_FIFTEENTH).to(tl.float16)
        lo16 = lo.to(tl.float16)
        return code4bit(xc, thr, lo16.to(tl.float32)[:, None], scale16.to(tl.float32)[:, None]), scale16, lo16
    scale16 = ((hi - lo) * ONE_THIRD).to(tl.float16)
    lo16 = lo.to(tl.float16)
    s = scale16.to(tl.float32)[:, None]
    d = xc - lo16.to(tl.float32)[:, None]
    t0 = (lv0 + lv1) * 0.5
    t1 = (lv1 + lv2) * 0.5
    t2 = (lv2 + lv3) * 0.5
    codes = (d >= t0 * s).to(tl.int32) + (d >= t1 * s).to(tl.int32) + (d >= t2 * s).to(tl.int32)
    return codes, scale16, lo16


@triton.jit
def _store_tile(x, codes_ptr, params_ptr, page_head, removals, lv0, lv1, lv2, lv3,
                P: tl.constexpr, D: tl.constexpr, G: tl.constexpr, CHANNEL: tl.constexpr,
                PACKING: tl.constexpr = 0, BITS: tl.constexpr = 2):
    """Quantize the tile ``x [P, D]`` fp32 and store it as page-head ``page_head`` (int64) of the pool
    (``BITS``-bit codes, ``reference.pack_codes`` order)."""
    CPB: tl.constexpr = 8 // BITS  # codes per byte
    Q: tl.constexpr = G // CPB
    NG: tl.constexpr = D // G
    RB_: tl.constexpr = D // CPB  # code bytes per row
    t = tl.arange(0, P)
    i = tl.arange(0, D)
    b = tl.arange(0, RB_)
    shifts = (1 << (BITS * tl.arange(0, CPB)))  # [CPB]: bit position of field j as a multiplier
    if CHANNEL:
        xt = tl.trans(x)  # [D, P]: one group per channel, over the P tokens of the page
        codes, scale16, lo16 = _clip_quantize(tl.abs(xt), xt, removals, lv0, lv1, lv2, lv3, P, BITS)
        if PACKING != 0:
            store_codes_mma16(codes_ptr + page_head * (P * RB_), tl.trans(codes), 0, P, D, P, PACKING, BITS)
        else:
            c4 = tl.reshape(codes, (NG, CPB, Q, P))
            packed = tl.sum(c4 * shifts[None, :, None, None], axis=1)  # [NG, Q, P]
            packed = tl.reshape(packed, (RB_, P))
            tl.store(codes_ptr + page_head * (P * RB_) + t[None, :] * RB_ + b[:, None], packed.to(tl.uint8))
        prm = params_ptr + page_head * (2 * D)
        tl.store(prm + i, scale16)
        tl.store(prm + D + i, lo16)
    else:
        xg = tl.reshape(x, (P * NG, G))  # one group per row segment
        codes, scale16, lo16 = _clip_quantize(tl.abs(xg), xg, removals, lv0, lv1, lv2, lv3, G, BITS)
        if PACKING != 0:
            store_codes_mma16(codes_ptr + page_head * (P * RB_), tl.reshape(codes, (P, D)), 0, P, D, P, PACKING,
                               BITS)
        else:
            c4 = tl.reshape(codes, (P * NG, CPB, Q))
            packed = tl.sum(c4 * shifts[None, :, None], axis=1)  # [P*NG, Q]
            packed = tl.reshape(packed, (P, RB_))
            tl.store(codes_ptr + page_head * (P * RB_) + t[:, None] * RB_ + b[None, :], packed.to(tl.uint8))
        rg = tl.arange(0, P * NG)
        prm = params_ptr + page_head * (P * NG * 2)
        tl.store(prm + rg * 2, scale16)
        tl.store(prm + rg * 2 + 1, lo16)


@triton.jit
def _quant_pack_kernel(
    x_ptr, page_ids_ptr, rank_ptr, levels_ptr, rot_ptr, dscale_ptr, mean_ptr,
    codes_ptr, params_ptr,
    stride_xn, stride_xh, stride_xp,
    H_KV: tl.constexpr, P: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    CHANNEL: tl.constexpr, ROTATE: tl.constexpr, ROUND_BF16: tl.constexpr, ROUND_FP16: tl.constexpr,
    PACKING: tl.constexpr, BITS: tl.constexpr,
):
    """Quantize page ``n`` of KV head ``h`` into pool page ``page_ids[n]``. Grid ``(N, H_kv)``.

    Parameters (pointers unless noted; the export bundle relies on this order):
        x_ptr        float rows ``[N, H_kv, P, D]`` (last dim contiguous; fp32/bf16/fp16)
        page_ids_ptr int32 ``[N]`` destination page of each input page
        rank_ptr     int32 ``[H_kv]`` removals per group, ``group - 1 - clip_rank``
        levels_ptr   fp32 ``[H_kv, 4]`` code levels
        rot_ptr, dscale_ptr, mean_ptr  fp32 ``[H_kv, D, D]``, ``[H_kv, D]``, ``[H_kv, D]`` (read iff ROTATE)
        codes_ptr    uint8 pool ``[N_pool, H_kv, P, D * BITS / 8]``
        params_ptr   fp16 pool, token ``[N_pool, H_kv, P, D // G, 2]``, channel ``[N_pool, H_kv, 2, D]``
        stride_xn, stride_xh, stride_xp  int32 element strides of x
        constexpr: H_KV, P, D, G, CHANNEL (per-channel-within-page groups), ROTATE, ROUND_BF16/ROUND_FP16
        (round the rotated rows through that dtype before quantizing), PACKING (``layout.packing_code`` of the
        pool: linear, mma16 keys, mma16 values), BITS (``RowFormat.bits`` of the pool: 2, or 4 with uniform
        levels, ``levels_ptr`` then unread).
    """
    n = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(page_ids_ptr + n).to(tl.int64)
    removals = tl.load(rank_ptr + h)
    lv0 = tl.load(levels_ptr + h * 4 + 0)
    lv1 = tl.load(levels_ptr + h * 4 + 1)
    lv2 = tl.load(levels_ptr + h * 4 + 2)
    lv3 = tl.load(levels_ptr + h * 4 + 3)
    x_base = x_ptr + n.to(tl.int64) * stride_xn + h * stride_xh
    if ROTATE:
        t = tl.arange(0, P)
        i = tl.arange(0, D)
        if D <= 128:
            x = tl.load(x_base + t[:, None] * stride_xp + i[None, :]).to(tl.float32)  # [P, D]
            r = tl.load(rot_ptr + h * D * D + i[:, None] * D + i[None, :])  # [D, D]
            x = tl.dot(x, r, input_precision="ieee")
        else:  # R [D, D] fp32 does not fit in shared memory: ROT_K rows of it per step
            x = tl.zeros((P, D), tl.float32)
            for k0 in range(0, D, ROT_K):
                kk = k0 + tl.arange(0, ROT_K)
                xk = tl.load(x_base + t[:, None] * stride_xp + kk[None, :]).to(tl.float32)  # [P, ROT_K]
                x = tl.dot(xk, tl.load(rot_ptr + h * D * D + kk[:, None] * D + i[None, :]), x, input_precision="ieee")
        x = x * tl.load(dscale_ptr + h * D + i)[None, :] - tl.load(mean_ptr + h * D + i)[None, :]
        if ROUND_BF16:
            x = round_bf16(x)
        if ROUND_FP16:
            x = x.to(tl.float16).to(tl.float32)
        _store_tile(x, codes_ptr, params_ptr, page * H_KV + h, removals, lv0, lv1, lv2, lv3, P, D, G, CHANNEL,
                    PACKING, BITS)
    else:
        quantize_page(x_base, stride_xp, codes_ptr, params_ptr, page * H_KV + h, removals, lv0, lv1, lv2, lv3,
                       P, D, G, CHANNEL, PACKING, BITS)


# ---- wrapper ------------------------------------------------------------------------------------------------


def removal_counts(clip: torch.Tensor, group: int) -> torch.Tensor:
    """int32 ``[H_kv]``: ``group - 1 - clip_rank(clip, group)`` (values the kernel drops before the max)."""
    return (group - 1 - clip_rank(clip, group)).to(torch.int32)


#: ``round_dtype`` of :func:`write_pages` as the launch plan names it.
_ROUND_TO = {None: None, torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_pages(
    x: torch.Tensor,
    page_ids: torch.Tensor,
    codes: torch.Tensor,
    params: torch.Tensor,
    layout: KVCacheLayout,
    fmt: RowFormat,
    clip: torch.Tensor,
    levels: torch.Tensor,
    rotation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    round_dtype: torch.dtype | None = torch.bfloat16,
    *,
    fused_rotation: bool = False,
    num_warps: int | None = None,
    operand: str = "key",
) -> None:
    """Quantize ``x`` page by page into the pool (in place), like ``reference.write_pages`` for one of K/V.

    Args:
        x: ``[N, H_kv, P, D]`` float32/bf16/fp16, last dim contiguous; stored basis, or model basis when
            ``rotation`` is given.
        page_ids: ``[N]`` int32 destination pool pages.
        codes: ``[N_pool, H_kv, P, D * fmt.bits / 8]`` uint8 pool (``layout.codes_shape(N_pool, fmt)``); params:
            fp16 pool (``layout.params_shape``).
        fmt: ``layout.key`` or ``layout.value``.
        clip: ``[H_kv]`` fp32 clip ratios; levels: ``[H_kv, 4]`` fp32 (the transform's 2-bit levels; 4-bit pages
            ignore them: ``reference.format_levels``).
        rotation: optional ``(R [H_kv, D, D], d [H_kv, D], mu [H_kv, D])`` fp32: quantize
            ``(x @ R) * d - mu`` rounded through ``round_dtype`` (None: not rounded). Computed with
            ``torch.matmul`` (as ``LayerTransform.transform_keys``) before the kernel unless
            ``fused_rotation``: then inside it, an fp32 FMA product (the AOT bundle's ``_rot`` kernel),
            ~10x slower on the H200.
        num_warps: launch width (benchmark sweeps); None: the default, which the AOT bundle mirrors.
        operand: ``"key"`` or ``"value"``, the pool written (``fmt.packing == "mma16"`` orders them
            differently: ``reference.pack_page_codes``).
    """
    h, p, d = layout.num_kv_heads, layout.page_size, layout.head_dim
    check_format(fmt, p, "write_pages")
    packing_code(fmt, operand)  # an unknown operand is refused before the tensors are checked
    if fmt.head_dim != d:
        raise ValueError(f"fmt.head_dim: expected {d}, got {fmt.head_dim}")
    dev = x.device
    if x.dim() != 4 or tuple(x.shape[1:]) != (h, p, d):
        raise ValueError(f"x: expected [N, {h}, {p}, {d}], got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x: expected float32, bfloat16 or float16, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"x: the last dim must be contiguous, got strides {x.stride()}")
    n = x.shape[0]
    check_tensor("page_ids", page_ids, (n,), torch.int32, dev)
    pool = codes.shape[0] if codes.dim() == 4 else -1
    check_tensor("codes", codes, layout.codes_shape(pool, fmt), torch.uint8, dev)
    check_tensor("params", params, layout.params_shape(fmt, pool), torch.float16, dev)
    if not (codes.is_contiguous() and params.is_contiguous()):
        raise ValueError("codes/params: the page pool must be contiguous")
    check_tensor("clip", clip, (h,), torch.float32, dev)
    check_tensor("levels", levels, (h, 4), torch.float32, dev)
    if rotation is not None:
        rot, ds, mu = rotation
        check_tensor("rotation", rot, (h, d, d), torch.float32, dev)
        check_tensor("rotation scale", ds, (h, d), torch.float32, dev)
        check_tensor("rotation mean", mu, (h, d), torch.float32, dev)
        rot, ds, mu = rot.contiguous(), ds.contiguous(), mu.contiguous()
    else:
        rot = ds = mu = levels  # never read
    if round_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"round_dtype: expected None, bfloat16 or float16, got {round_dtype}")
    if n == 0:
        return
    group = p if fmt.granularity == "channel" else fmt.group_size
    removals = removal_counts(clip, group)
    fuse = rotation is not None and fused_rotation
    # the launch plan's (QUANT_PACK_ROT: the fused rotation's [P, D] fp32 tile spills far less on 8 warps)
    plan = _plan.QUANT_PACK_ROT if fuse else _plan.QUANT_PACK
    cx = _plan.quant_pack_constexprs(layout, fmt, fuse, operand, _ROUND_TO[round_dtype])
    if rotation is not None and not fused_rotation:
        x = torch.matmul(x.float(), rot) * ds[:, None, :] - mu[:, None, :]
        x = x if round_dtype is None else x.to(round_dtype)
    _quant_pack_kernel[plan.grid_for({"N": n}, cx)](
        x, page_ids, removals, levels.contiguous(), rot, ds, mu, codes, params,
        x.stride(0), x.stride(1), x.stride(2),
        **cx, num_warps=plan.num_warps if num_warps is None else num_warps,
    )


def quantize_pages(
    x: torch.Tensor,
    layout: KVCacheLayout,
    fmt: RowFormat,
    clip: torch.Tensor,
    levels: torch.Tensor,
    rotation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    round_dtype: torch.dtype | None = torch.bfloat16,
    *,
    fused_rotation: bool = False,
    num_warps: int | None = None,
    operand: str = "key",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.quantize_pages`` on the GPU: ``x [N, H_kv, P, D]`` -> (codes uint8, params fp16).

    ``fused_rotation``, ``num_warps``, ``operand``: as :func:`write_pages`.
    """
    n = x.shape[0] if x.dim() == 4 else 0
    codes = torch.empty(layout.codes_shape(n, fmt), dtype=torch.uint8, device=x.device)
    params = torch.empty(layout.params_shape(fmt, n), dtype=torch.float16, device=x.device)
    ids = torch.arange(n, dtype=torch.int32, device=x.device)
    write_pages(x, ids, codes, params, layout, fmt, clip, levels, rotation, round_dtype,
                fused_rotation=fused_rotation, num_warps=num_warps, operand=operand)
    return codes, params



hash_bottom_up(globals())  # one Triton cache key per kernel, whatever launches first (cache_keys.py)

__all__ = ["quantize_page", "quantize_pages", "removal_counts", "round_bf16", "write_pages"]
