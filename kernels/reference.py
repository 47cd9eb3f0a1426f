"""What the bytes mean: the readable PyTorch definition of every cache op.

This is the test oracle for the Triton kernels and the ``torch.compile`` path of the Hugging Face
integration. The pure functions (pack, quantize, dequantize, attention) are static-shape and free of
``.item()`` and value-dependent branching, so they compile with ``torch.compile(fullgraph=True)``. The
decode step's writer (``decode_append``) is device-only too; ``write_tokens`` (prompts, chunks) reads
host ints.

Quantization of one group ``x`` (docs/design.md §3.1), bit-exact in every implementation:

    thr   = sorted(|x|)[rank]                      rank = clip_rank(ratio, len(x)); ratio 1 -> max
    xc    = clamp(x, -thr, thr)
    scale = fp16((max(xc) - min(xc)) * fp32(1/3));  lo = fp16(min(xc))
    d     = xc - float(lo)
    code  = [d >= t0 * s] + [d >= t1 * s] + [d >= t2 * s],  t_j = (levels[j] + levels[j+1]) / 2, s = float(scale)
    x_hat = float(lo) + float(scale) * levels[code]

No division anywhere, so torch and Triton agree to the bit. The same rule with ``2**b`` levels (``levels``
of length ``2**b``, ``1/3`` replaced by ``fp32(1 / (2**b - 1))``, :func:`span_inverse`) is the ``b``-bit quantizer:
the 4-bit key pages of ``RowFormat.bits == 4`` (uniform levels ``0..15``, :func:`format_levels`) and the
evaluation's wider-code levers.
"""

from __future__ import annotations

import struct
from typing import Callable

import torch

from .layout import ONE_THIRD_F32, KVCacheLayout, PagedKV, RowFormat
from .transform import LayerTransform, clip_rank

# ---- packing ------------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, group_size: int, bits: int = 2) -> torch.Tensor:
    """``[..., D]`` uint8 codes in ``0 .. 2**bits - 1`` -> ``[..., D * bits / 8]`` uint8 (``c = 8 / bits`` per byte).

    Within each group of ``G`` elements, byte ``b`` holds elements ``b + j G / c`` at bits ``j * bits``
    (2-bit: ``b, b+G/4, b+G/2, b+3G/4`` at bits 0, 2, 4, 6; 4-bit: ``b, b+G/2`` at bits 0, 4).
    """
    *lead, d = codes.shape
    per = 8 // bits
    c = codes.to(torch.uint8).reshape(*lead, d // group_size, per, group_size // per)
    packed = c[..., 0, :]
    for j in range(1, per):
        packed = packed | (c[..., j, :] << (j * bits))
    return packed.reshape(*lead, d // per)


def unpack_codes(packed: torch.Tensor, group_size: int, bits: int = 2) -> torch.Tensor:
    """``[..., D * bits / 8]`` uint8 -> ``[..., D]`` uint8 codes (inverse of :func:`pack_codes`)."""
    *lead, nb = packed.shape
    per = 8 // bits
    q = group_size // per
    p = packed.reshape(*lead, nb // q, 1, q)
    shifts = (torch.arange(per, dtype=torch.uint8, device=packed.device) * bits).view(per, 1)
    c = (p >> shifts) & ((1 << bits) - 1)  # [..., D/G, per, G/per]
    return c.reshape(*lead, nb * per)


# ---- the mma16 packing (RowFormat.packing == "mma16") ---------------------------------------------------------


def mma16_group(rows: int, cols: int, bits: int = 2) -> int:
    """``MB``: 16-row blocks interleaved per lane so that one lane's run of bytes is 16 bytes when ``cols * bits <
    256`` (``MB = 256 // (cols * bits)`` where that divides the ``rows // 16`` blocks, else 1). See
    :func:`pack_mma16`."""
    mb = 256 // (cols * bits) if cols * bits < 256 else 1
    return mb if (rows // 16) % mb == 0 else 1


def pack_mma16(codes: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """``[..., R, C]`` uint8 codes in 0..3 (``R % 16 == 0``, ``C % 32 == 0``) -> ``[..., R * C // 4]`` uint8 in the
    fragment order of ``mma.sync.m16n8k16`` (and of ``wgmma`` with A from registers): the matrix is the MMA's
    A operand, R on M, C on K. Keys pack their ``[P, D]`` codes (tokens on M), values their transposed
    ``[D, P]`` codes (dims on M, tokens on K): see :func:`pack_page_codes`.

    Bit mapping. Write a row as ``r = 16 * (MB * mo + mi) + 8 * hr + g`` and a column as
    ``c = 32 * w + 16 * kb + 8 * hc + 2 * tq + e`` (``g < 8, tq < 4``; ``hr, kb, hc, e`` bits; ``MB`` from
    :func:`mma16_group`). Code ``(r, c)`` sits in byte

        ``(((mo * 32 + lane) * MB + mi) * (C // 32) + w) * 4 + 2 * e + kb``,  ``lane = 4 * g + tq``,

    at bits ``2 * (2 * hc + hr)``. Read as little-endian 32-bit words (word ``((mo * 32 + lane) * MB + mi) *
    (C // 32) + w``), field ``k = 4 * kb + 2 * hc + hr`` of a word is at bits ``2k`` (column ``c``, ``e = 0``)
    and ``16 + 2k`` (column ``c + 1``, ``e = 1``), so ``(word >> 2k) & 0x00030003`` are the two codes of one
    ``half2`` register: A-fragment register ``a[hr + 2 * hc]`` of lane ``lane`` for the 16x16 tile (row block
    ``MB * mo + mi``, column block ``2 * w + kb``), which holds rows ``g + 8 * hr`` and columns
    ``2 * tq + 8 * hc + {0, 1}`` (PTX ISA, m16n8k16 f16 A layout). One lane's ``MB * C / 8`` bytes are
    contiguous (16 bytes for C = 128, or C = 64 with MB = 2), lanes follow each other: a warp's
    ``MB`` row blocks are one coalesced 512-byte load, one 16-byte vector per thread, and ``OR 0x64006400``
    turns each masked pair into ``1024 + c`` as fp16x2 (the LOP3 / magic-number conversion).

    Worked example, R = 16, C = 32 (MB = 1, 128 bytes): code (0, 0) -> byte 0 bits 0-1; (8, 0) -> byte 0 bits
    2-3 (hr); (0, 8) -> byte 0 bits 4-5 (hc); (0, 1) -> byte 2 bits 0-1 (e); (0, 16) -> byte 1 (kb);
    (0, 2) -> byte 4 (lane 1); (1, 0) -> byte 16 (lane 4).

    ``bits=4`` (the 4-bit key pages, codes in 0..15, ``C % 16 == 0``): a word holds one 16x16 tile's fragment,
    column ``c = 16 * w + 8 * hc + 2 * tq + e``; code ``(r, c)`` sits in byte ``(((mo * 32 + lane) * MB + mi) *
    (C // 16) + w) * 4 + 2 * e + hc`` at bits ``4 * hr`` (``MB = mma16_group(R, C, 4)``): field ``k = 2 * hc + hr``
    of a word at bits ``4k`` and ``16 + 4k``, so ``(word >> 8 hc) & (0x000F000F << 4 hr)`` is register ``a[hr + 2
    * hc]`` as a ``half2`` of ``c·16^hr`` subnormals. Worked example, R = 16, C = 16 (128 bytes): (0, 0) -> byte 0
    bits 0-3; (8, 0) -> byte 0 bits 4-7 (hr); (0, 8) -> byte 1 (hc); (0, 1) -> byte 2 (e); (0, 2) -> byte 4.
    """
    *lead, r, c = codes.shape
    if bits == 4:
        return _pack_mma16_4bit(codes)
    if bits != 2:
        raise ValueError(f"pack_mma16: bits 2 or 4, got {bits}")
    if r % 16 or c % 32:
        raise ValueError(f"pack_mma16: expected [..., R, C] with R % 16 == 0 and C % 32 == 0, got {list(codes.shape)}")
    mb = mma16_group(r, c)
    n = len(lead)
    x = codes.to(torch.uint8).reshape(*lead, r // (16 * mb), mb, 2, 8, c // 32, 2, 2, 4, 2)
    # axes after lead: mo mi hr g w kb hc tq e  ->  mo g tq mi w e kb hc hr
    x = x.permute(*range(n), n + 0, n + 3, n + 7, n + 1, n + 4, n + 8, n + 5, n + 6, n + 2)
    x = x.reshape(*lead, r * c // 4, 4)  # [..., byte, field 2*hc + hr]
    packed = x[..., 0] | (x[..., 1] << 2) | (x[..., 2] << 4) | (x[..., 3] << 6)
    return packed


def _pack_mma16_4bit(codes: torch.Tensor) -> torch.Tensor:
    """:func:`pack_mma16` with ``bits=4``: ``[..., R, C]`` codes in 0..15 -> ``[..., R * C // 2]`` uint8."""
    *lead, r, c = codes.shape
    if r % 16 or c % 16:
        raise ValueError(f"pack_mma16: 4-bit codes need [..., R, C] with R % 16 == 0 and C % 16 == 0, "
                         f"got {list(codes.shape)}")
    mb = mma16_group(r, c, 4)
    n = len(lead)
    x = codes.to(torch.uint8).reshape(*lead, r // (16 * mb), mb, 2, 8, c // 16, 2, 4, 2)
    # axes after lead: mo mi hr g w hc tq e  ->  mo g tq mi w e hc hr
    x = x.permute(*range(n), n + 0, n + 3, n + 6, n + 1, n + 4, n + 7, n + 5, n + 2)
    x = x.reshape(*lead, r * c // 2, 2)  # [..., byte, hr]
    return x[..., 0] | (x[..., 1] << 4)


def unpack_mma16(packed: torch.Tensor, rows: int, cols: int, bits: int = 2) -> torch.Tensor:
    """``[..., rows * cols * bits // 8]`` uint8 -> ``[..., rows, cols]`` uint8 codes (inverse of :func:`pack_mma16`)."""
    *lead, nb = packed.shape
    if bits == 4:
        if nb * 2 != rows * cols or rows % 16 or cols % 16:
            raise ValueError(f"unpack_mma16: {nb} bytes cannot hold [{rows}, {cols}] 4-bit codes in mma16 order")
        mb = mma16_group(rows, cols, 4)
        n = len(lead)
        f = (packed.unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)) & 15
        x = f.reshape(*lead, rows // (16 * mb), 8, 4, mb, cols // 16, 2, 2, 2)
        # axes after lead: mo g tq mi w e hc hr  ->  mo mi hr g w hc tq e
        x = x.permute(*range(n), n + 0, n + 3, n + 7, n + 1, n + 4, n + 6, n + 2, n + 5)
        return x.reshape(*lead, rows, cols)
    if nb * 4 != rows * cols or rows % 16 or cols % 32:
        raise ValueError(f"unpack_mma16: {nb} bytes cannot hold [{rows}, {cols}] codes in mma16 order")
    mb = mma16_group(rows, cols)
    n = len(lead)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    f = (packed.unsqueeze(-1) >> shifts) & 3  # [..., byte, field]
    x = f.reshape(*lead, rows // (16 * mb), 8, 4, mb, cols // 32, 2, 2, 2, 2)
    # axes after lead: mo g tq mi w e kb hc hr  ->  mo mi hr g w kb hc tq e
    x = x.permute(*range(n), n + 0, n + 3, n + 8, n + 1, n + 4, n + 6, n + 7, n + 2, n + 5)
    return x.reshape(*lead, rows, cols)


def pack_page_codes(codes: torch.Tensor, fmt: RowFormat, operand: str = "key") -> torch.Tensor:
    """``[..., P, D]`` codes of whole pages -> ``[..., P, D // 4]`` bytes in ``fmt.packing``.

    ``operand`` (``"key"`` or ``"value"``) matters for ``"mma16"`` only: keys are packed as the ``[P, D]`` A
    operand of ``S^T = K q^T`` (tokens on M), values as the ``[D, P]`` A operand of ``O^T = V^T p^T`` (dims
    on M). A round trip through :func:`unpack_page_codes` with the same arguments is exact either way; pages
    for the V pool must say ``operand="value"``.
    """
    if fmt.packing == "linear":
        return pack_codes(codes, fmt.group_size, fmt.bits)
    *lead, p, d = codes.shape
    if operand == "key":
        return pack_mma16(codes, fmt.bits).reshape(*lead, p, d // fmt.codes_per_byte)
    if operand == "value":
        return pack_mma16(codes.transpose(-1, -2), fmt.bits).reshape(*lead, p, d // fmt.codes_per_byte)
    raise ValueError(f"operand: expected 'key' or 'value', got {operand!r}")


def unpack_page_codes(packed: torch.Tensor, fmt: RowFormat, operand: str = "key") -> torch.Tensor:
    """``[..., P, D // 4]`` bytes in ``fmt.packing`` -> ``[..., P, D]`` codes (inverse of :func:`pack_page_codes`)."""
    if fmt.packing == "linear":
        return unpack_codes(packed, fmt.group_size, fmt.bits)
    *lead, p, nb = packed.shape
    d = nb * fmt.codes_per_byte
    flat = packed.reshape(*lead, p * nb)
    if operand == "key":
        return unpack_mma16(flat, p, d, fmt.bits)
    if operand == "value":
        return unpack_mma16(flat, d, p, fmt.bits).transpose(-1, -2).contiguous()
    raise ValueError(f"operand: expected 'key' or 'value', got {operand!r}")


# ---- one quantization group along the last axis ----------------------------------------------------------


def quantize_groups(
    x: torch.Tensor, rank: torch.Tensor, levels: torch.Tensor, sorted_abs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups along the last axis.

    Args:
        x: ``[..., n]`` float32 (the group is the last axis).
        rank: long, broadcastable to ``[..., 1]``: clip rank (see :func:`clip_rank`).
        levels: ``[..., n_levels]`` float32 broadcastable, ascending code levels (4 for the 2-bit format).
        sorted_abs: ``|x|`` sorted along the last axis, where the caller has it (calibration quantizes the same
            groups at every clip rank of its grid: one sort, not one a rank).
    Returns:
        codes ``[..., n]`` uint8, scale ``[...]`` fp16, lo ``[...]`` fp16.
    """
    x = x.float()
    if sorted_abs is None:
        thr = clip_threshold(x.abs(), rank)
    else:
        thr = torch.gather(sorted_abs, -1, rank.expand(*x.shape[:-1], 1))
    xc = torch.minimum(torch.maximum(x, -thr), thr)
    lo = xc.amin(dim=-1, keepdim=True)
    hi = xc.amax(dim=-1, keepdim=True)
    n_levels = levels.shape[-1]
    scale16 = ((hi - lo) * span_inverse(n_levels)).to(torch.float16)
    lo16 = lo.to(torch.float16)
    s = scale16.float()
    d = xc - lo16.float()
    lv = levels.float()
    t = (lv[..., :-1] + lv[..., 1:]) * 0.5  # [..., n_levels - 1]
    codes = (d >= t[..., 0:1] * s).to(torch.uint8)
    for j in range(1, n_levels - 1):  # static: 3 comparisons for the 2-bit format
        codes = codes + (d >= t[..., j : j + 1] * s).to(torch.uint8)
    return codes, scale16.squeeze(-1), lo16.squeeze(-1)


def clip_threshold(a: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """``sorted(a)[rank]`` along the last axis, ``[..., 1]``: the clip threshold of :func:`quantize_groups`.

    On the CPU outside compilation (a host read is free there) it is read from the ``n - min(rank)`` largest
    values (``topk``, the same element: about 3x cheaper than the full sort for the usual clips 0.9-1); elsewhere
    from the full sort (static shapes, no host read)."""
    n = a.shape[-1]
    idx = rank.expand(*a.shape[:-1], 1)
    if a.is_cuda or torch.compiler.is_compiling():
        return torch.gather(a.sort(dim=-1).values, -1, idx)
    top = a.topk(n - int(rank.min()), dim=-1).values  # descending: sorted(a)[r] is top[n - 1 - r]
    return torch.gather(top, -1, n - 1 - idx)


def span_inverse(n_levels: int) -> float:
    """fp32 of ``1 / (n_levels - 1)``, the factor the quantizer multiplies the group's range by
    (``ONE_THIRD_F32`` for the 2-bit format's 4 levels)."""
    if n_levels < 2:
        raise ValueError(f"levels: expected at least 2, got {n_levels}")
    return ONE_THIRD_F32 if n_levels == 4 else struct.unpack("f", struct.pack("f", 1.0 / (n_levels - 1)))[0]


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, levels: torch.Tensor
) -> torch.Tensor:
    """``lo + scale * levels[code]`` in float32; ``codes [..., n]``, ``scale``/``lo`` ``[...]``, ``levels [..., 4]``."""
    lv = levels.float().expand(*codes.shape[:-1], levels.shape[-1])
    val = torch.gather(lv, -1, codes.long())
    return lo.float().unsqueeze(-1) + scale.float().unsqueeze(-1) * val


# ---- pages ------------------------------------------------------------------------------------------------------


def format_levels(fmt: RowFormat, levels: torch.Tensor) -> torch.Tensor:
    """The code levels pages of ``fmt`` use: ``levels [H_kv, 4]`` (the transform's, uniform or a codebook) for
    2-bit codes, the uniform ``0 .. 2**bits - 1`` (``[H_kv, 2**bits]``) for wider ones."""
    if fmt.bits == 2:
        return levels
    lv = torch.arange(fmt.levels, dtype=torch.float32, device=levels.device)
    return lv.expand(levels.shape[0], fmt.levels)


def quantize_pages(
    x: torch.Tensor, fmt: RowFormat, clip: torch.Tensor, levels: torch.Tensor, operand: str = "key"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize whole pages of rows already in the stored basis.

    Args:
        x: ``[N, H_kv, P, D]`` float.
        fmt: row format (token or channel granularity).
        clip: ``[H_kv]`` clip ratios.
        levels: ``[H_kv, 4]`` code levels of the 2-bit format (ignored for wider codes: :func:`format_levels`).
        operand: ``"key"`` or ``"value"``: which pool the pages are for (``fmt.packing == "mma16"`` packs the
            two differently, :func:`pack_page_codes`).
    Returns:
        codes ``[N, H_kv, P, D * bits / 8]`` uint8 (in ``fmt.packing``) and params fp16 (``[N, H_kv, P, D // G, 2]``
        token, ``[N, H_kv, 2, D]`` channel).
    """
    n, h, p, d = x.shape
    levels = format_levels(fmt, levels)
    nl = levels.shape[-1]
    if fmt.granularity == "token":
        g = fmt.group_size
        rank = clip_rank(clip.to(x.device), g).view(1, h, 1, 1, 1)
        codes, scale, lo = quantize_groups(x.reshape(n, h, p, d // g, g), rank, levels.view(1, h, 1, 1, nl))
        return pack_page_codes(codes.reshape(n, h, p, d), fmt, operand), torch.stack([scale, lo], dim=-1)
    rank = clip_rank(clip.to(x.device), p).view(1, h, 1, 1)
    codes, scale, lo = quantize_groups(x.transpose(-1, -2), rank, levels.view(1, h, 1, nl))  # [N, H, D, P]
    codes = codes.transpose(-1, -2)
    return pack_page_codes(codes, fmt, operand), torch.stack([scale, lo], dim=-2)


def dequantize_pages(
    codes: torch.Tensor, params: torch.Tensor, fmt: RowFormat, levels: torch.Tensor, operand: str = "key"
) -> torch.Tensor:
    """Inverse of :func:`quantize_pages`: ``[..., H_kv, P, D * bits / 8]`` -> ``[..., H_kv, P, D]`` float32.

    Leading dims are free (``[N]`` for the pool, ``[B, M]`` for gathered block tables); ``levels [H_kv, 4]``
    (:func:`format_levels`); ``operand`` as in :func:`quantize_pages`.
    """
    c = unpack_page_codes(codes, fmt, operand)  # [..., H, P, D]
    *lead, h, p, d = c.shape
    levels = format_levels(fmt, levels)
    nl = levels.shape[-1]
    if fmt.granularity == "token":
        g = fmt.group_size
        lv = levels.reshape(*([1] * len(lead)), h, 1, 1, nl)
        out = dequantize_groups(c.reshape(*lead, h, p, d // g, g), params[..., 0], params[..., 1], lv)
        return out.reshape(*lead, h, p, d)
    lv = levels.reshape(*([1] * len(lead)), h, 1, nl)
    out = dequantize_groups(c.transpose(-1, -2), params[..., 0, :], params[..., 1, :], lv)
    return out.transpose(-1, -2)


# ---- attention over the mixed-precision cache -------------------------------------------------------------


def gather_context(
    state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor, memo: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's cache as dense float32 ``[B, H_kv, S0 + M*P + C, D]`` K and V and a ``[B, T]`` mask.

    Order along T: sink slots, then the ``M = block_table.shape[1]`` page slots, then the recent ring's
    ``C`` slots (ring order, not token order: attention does not care); the mask marks the slots a
    sequence actually holds. ``memo``: the eager host form, :func:`gather_context_memo` (the same tensors).
    """
    if memo is not None:
        return gather_context_memo(state, layout, k_levels, v_levels, memo)
    b, m = state.block_table.shape
    p = layout.page_size
    pool = state.k_codes.shape[0]
    ids = state.block_table.long().clamp(0, pool - 1)  # entries past num_pages are masked below
    k_hist = dequantize_pages(state.k_codes[ids], state.k_params[ids], layout.key, k_levels)  # [B, M, H, P, D]
    v_hist = dequantize_pages(state.v_codes[ids], state.v_params[ids], layout.value, v_levels, "value")
    h, d = layout.num_kv_heads, layout.head_dim
    k_hist = k_hist.permute(0, 2, 1, 3, 4).reshape(b, h, m * p, d)
    v_hist = v_hist.permute(0, 2, 1, 3, 4).reshape(b, h, m * p, d)
    k = torch.cat([state.sink_k.float(), k_hist, state.recent_k.float()], dim=2)
    v = torch.cat([state.sink_v.float(), v_hist, state.recent_v.float()], dim=2)
    return k, v, context_mask(state, layout)


def context_mask(state: PagedKV, layout: KVCacheLayout) -> torch.Tensor:
    """``[B, S0 + M*P + C]`` bool: the slots of :func:`gather_context`'s order that each sequence holds."""
    m, p = state.block_table.shape[1], layout.page_size
    dev = state.block_table.device
    return torch.cat(
        [
            torch.arange(layout.sink, device=dev)[None, :] < state.sink_len[:, None],
            torch.arange(m * p, device=dev)[None, :] < (state.num_pages[:, None] * p),
            recent_valid(layout, state.num_pages, state.recent_len),
        ],
        dim=1,
    )


def read_sequence(
    state: PagedKV, layout: KVCacheLayout, b: int, k_levels: torch.Tensor, v_levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What sequence ``b`` holds in token order (sink, pages, recent): ``[H_kv, L, D]`` fp32 K and V, stored
    basis, ``L`` its length (read on the host from the state's lengths)."""
    sink, pages = int(state.sink_len[b]), int(state.num_pages[b])
    recent = int(state.recent_len[b])
    ids = state.block_table[b, :pages].long()
    k_pg = dequantize_pages(state.k_codes[ids], state.k_params[ids], layout.key, k_levels)  # [n, H, P, D]
    v_pg = dequantize_pages(state.v_codes[ids], state.v_params[ids], layout.value, v_levels, "value")
    h, d, p = layout.num_kv_heads, layout.head_dim, layout.page_size
    slots = layout.recent_slot(torch.arange(pages * p, pages * p + recent, device=state.recent_k.device))
    parts_k = [state.sink_k[b, :, :sink].float(), k_pg.transpose(0, 1).reshape(h, -1, d),
               state.recent_k[b][:, slots].float()]
    parts_v = [state.sink_v[b, :, :sink].float(), v_pg.transpose(0, 1).reshape(h, -1, d),
               state.recent_v[b][:, slots].float()]
    return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention in float32.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, H_kv, Tk, D]``; mask: ``[B, Tq, Tk]`` bool (True = attend).
    Returns:
        ``[B, H, Tq, D]`` float32. Rows with nothing to attend give zeros.
    """
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(b, hkv, (h // hkv) * tq, d)
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [B, H_kv, g*Tq, Tk]
    s = s.view(b, hkv, h // hkv, tq, -1).masked_fill(~mask[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.matmul(p.view(b, hkv, (h // hkv) * tq, -1), v.float())
    return o.view(b, h, tq, d)


def decode_attention(
    q: torch.Tensor,
    state: PagedKV,
    layout: KVCacheLayout,
    k_levels: torch.Tensor,
    v_levels: torch.Tensor,
    scale: float,
    memo: dict | None = None,
) -> torch.Tensor:
    """One decode step over sink + INT2 pages + recent, in the stored basis.

    Args:
        q: ``[B, H, D]`` queries already in the stored key basis (``LayerTransform.transform_queries``).
        state: the layer's cache, the new token already appended.
        memo: one layer's dict kept between its steps in eager host code (:func:`gather_context_memo`), or None.
    Returns:
        ``[B, H, D]`` float32 in the stored value basis (``LayerTransform.restore_output`` undoes it).
    """
    k, v, valid = gather_context(state, layout, k_levels, v_levels, memo)
    return masked_attention(q.unsqueeze(2), k, v, valid[:, None, :], scale).squeeze(2)


def chunk_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    state: PagedKV,
    layout: KVCacheLayout,
    k_levels: torch.Tensor,
    v_levels: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A prefill chunk attending to the cache as stored (INT2 history, BF16 windows) and causally to itself.

    Args:
        q: ``[B, H, Tq, D]`` stored basis; k_new, v_new: ``[B, H_kv, Tq, D]`` stored basis (full precision).
        state: the cache before this chunk is written.
    Returns:
        ``[B, H, Tq, D]`` float32, stored value basis. Scores are formed a block of queries at a time.
    """
    k, v, valid = gather_context(state, layout, k_levels, v_levels)
    b, h, tq, _ = q.shape
    k, v = torch.cat([k, k_new.float()], 2), torch.cat([v, v_new.float()], 2)
    tk = k.shape[2]
    # query blocks keep the scores at most ~2^26 elements: memory linear in the history, not [Tq, Tk]
    block = max(1, min(tq, (1 << 26) // max(1, b * h * tk)))
    out = []
    for t0 in range(0, tq, block):
        t1 = min(tq, t0 + block)
        causal = torch.arange(tq, device=q.device)[None, :] <= torch.arange(t0, t1, device=q.device)[:, None]
        mask = torch.cat([valid[:, None, :].expand(-1, t1 - t0, -1), causal[None].expand(b, -1, -1)], dim=2)
        out.append(masked_attention(q[:, :, t0:t1], k, v, mask, scale))
    return torch.cat(out, dim=2)


# ---- cache writers --------------------------------------------------------------------------------------


def recent_valid(layout: KVCacheLayout, num_pages: torch.Tensor, recent_len: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` bool: which recent ring slots hold a token. The ring starts at slot ``(num_pages * P) mod C``
    and holds ``recent_len`` tokens from there (``layout.py``)."""
    c = layout.recent_slots
    start = (num_pages.long() * layout.page_size) % c
    slot = torch.arange(c, device=num_pages.device)
    return (slot[None, :] - start[:, None]) % c < recent_len[:, None]


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise if ``x`` holds NaN or Inf: one would silently turn a whole page into garbage."""
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"{what}: {bad} non-finite values (NaN/Inf) would enter the cache")


def write_pages(
    state: PagedKV, page_ids: list[int], k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform,
) -> None:
    """Quantize ``k, v [N, H_kv, P, D]`` (stored basis) into the pool pages ``page_ids``."""
    kc, kp = quantize_pages(k, layout.key, transform.k_clip, transform.k_levels)
    vc, vp = quantize_pages(v, layout.value, transform.v_clip, transform.v_levels, "value")
    idx = torch.tensor(page_ids, dtype=torch.long, device=state.k_codes.device)
    state.k_codes.index_copy_(0, idx, kc)
    state.k_params.index_copy_(0, idx, kp)
    state.v_codes.index_copy_(0, idx, vc)
    state.v_params.index_copy_(0, idx, vp)


def write_tokens(
    state: PagedKV,
    b: int,
    start: int,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: KVCacheLayout,
    transform: LayerTransform,
    write: Callable | None = None,
) -> None:
    """Write ``T`` tokens at positions ``start .. start + T - 1`` of sequence ``b`` (a prompt or a chunk).

    Args:
        state: the cache; its lengths are not read or changed (the caller's page book commits them):
            ``start`` is the committed length of ``b``.
        k, v: ``[H_kv, T, D]`` in the stored basis.
        write: page quantizer with :func:`write_pages`' signature (default); backends pass their kernel.
    Positions below ``S0`` go to the sink; every page that ``layout.split(start + T)`` has and
    ``layout.split(start)`` has not is quantized whole from the recent tokens it takes (those already in
    the ring, then the new ones) into ``block_table[b, n]``; the new tokens that stay recent go to their
    ring slots. A T-token write and T single-token decode appends leave identical bytes.
    """
    write = write or write_pages
    t = k.shape[1]
    s0 = layout.sink
    n_sink = max(0, min(s0 - start, t))
    if n_sink:
        state.sink_k[b, :, start : start + n_sink] = k[:, :n_sink].to(state.sink_k.dtype)
        state.sink_v[b, :, start : start + n_sink] = v[:, :n_sink].to(state.sink_v.dtype)
    k, v = k[:, n_sink:].to(state.recent_k.dtype), v[:, n_sink:].to(state.recent_v.dtype)
    _, pages0, recent0 = layout.split(start)
    _, pages1, _ = layout.split(start + t)
    p = layout.page_size
    first = pages0 * p  # recent index of the oldest recent token before the write
    dev = state.recent_k.device
    n_new = 0  # new tokens that go straight into pages
    if pages1 > pages0:
        if pages1 > state.block_table.shape[1]:
            raise ValueError(f"write_tokens: sequence {b} needs {pages1} pages, its block table has "
                             f"{state.block_table.shape[1]}")
        n_page_rows = (pages1 - pages0) * p
        held = min(recent0, n_page_rows)  # the oldest recent tokens fill the new pages first
        n_new = n_page_rows - held
        slots = layout.recent_slot(torch.arange(first, first + held, device=dev))
        kk = torch.cat([state.recent_k[b][:, slots], k[:, :n_new]], dim=1)  # [H_kv, n_pages * P, D]
        vv = torch.cat([state.recent_v[b][:, slots], v[:, :n_new]], dim=1)
        h, d = kk.shape[0], kk.shape[2]
        kk = kk.reshape(h, pages1 - pages0, p, d).transpose(0, 1).contiguous()  # [n_pages, H_kv, P, D]
        vv = vv.reshape(h, pages1 - pages0, p, d).transpose(0, 1).contiguous()
        write(state, state.block_table[b, pages0:pages1].tolist(), kk, vv, layout, transform)
    # the other new tokens stay recent: new token j has recent index first + recent0 + j
    if k.shape[1] > n_new:
        idx0 = first + recent0 + n_new
        slots = layout.recent_slot(torch.arange(idx0, idx0 + k.shape[1] - n_new, device=dev))
        state.recent_k[b][:, slots] = k[:, n_new:]
        state.recent_v[b][:, slots] = v[:, n_new:]


def append_tokens(
    state: PagedKV,
    b: int,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: KVCacheLayout,
    transform: LayerTransform,
    allocate: Callable[[], int] | None = None,
    write: Callable | None = None,
) -> None:
    """Host-side convenience around :func:`write_tokens`: append ``k, v [H_kv, T, D]`` (stored basis) at the end
    of sequence ``b`` and advance its lengths in ``state`` (for tests and hosts that keep their own lengths;
    the caches commit through a page book instead).

    ``allocate`` (optional) returns a free pool page id for each new page, written into the block table
    first; without it the block table already names the pages. Raises on NaN/Inf before writing.
    """
    check_finite(k, "keys")
    check_finite(v, "values")
    length = int(state.sink_len[b]) + int(state.num_pages[b]) * layout.page_size + int(state.recent_len[b])
    sink, pages, recent = layout.split(length + k.shape[1])
    if pages > state.block_table.shape[1]:
        raise ValueError(f"append: sequence {b} needs {pages} pages, its block table has {state.block_table.shape[1]}")
    if allocate is not None:
        for n in range(int(state.num_pages[b]), pages):
            state.block_table[b, n] = allocate()
    write_tokens(state, b, length, k, v, layout, transform, write)
    state.sink_len[b], state.num_pages[b], state.recent_len[b] = sink, pages, recent


def decode_append(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform, skip_idle: bool = False,
) -> None:
    """Append one token to every sequence, demoting a page where the recent window is full: the decode step's
    write, all on the device (no host read, no value-dependent branch; compiles with ``fullgraph=True``).

    Args:
        state: the cache with its *committed* lengths (the page book's ``committed``), unchanged here.
        k, v: ``[B, H_kv, D]`` new rows in the stored basis.
        status: ``[B]`` int32 step status (``pages.STATUS_*``); a slot whose status is nonzero, or whose rows
            hold NaN/Inf (then ``STATUS_NONFINITE`` is set here), writes nothing.
    Where ``recent_len == W + P`` the oldest ``P`` recent tokens (ring slots ``(nP + j) mod C``) are quantized
    into ``block_table[b, n]``, ``n = num_pages``; the token goes to sink slot ``sink_len`` while the sink is
    not full, else to ring slot ``(nP + recent_len) mod C``. Both targets lie beyond the committed lengths.
    Every row writes its candidate page (unchanged where no demotion is due) in one indexed assignment, so the
    rows' ``block_table[b, num_pages[b]]`` must be distinct pages (a cache's reserved pages are; a host pool
    that leaves entries unassigned calls this one row at a time).
    ``skip_idle``: eager host code (the CPU path): :func:`decode_append_host`, which reads the lengths on the host
    and quantizes only the pages that are due (the same bytes; not for graph capture or fullgraph compile).
    """
    from .pages import STATUS_NONFINITE

    if skip_idle:
        return decode_append_host(state, k, v, status, layout, transform)
    bsz = k.shape[0]
    p, s0 = layout.page_size, layout.sink
    finite = torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1)
    status.bitwise_or_((~finite).to(torch.int32) * STATUS_NONFINITE)
    ok = status == 0
    bi = torch.arange(bsz, device=k.device)
    to_sink = state.sink_len < s0
    n = state.num_pages.long()
    # demotion: every slot computes its candidate page, only due slots store it
    due = ok & ~to_sink & (state.recent_len == layout.recent_capacity)
    rows = layout.recent_slot(n[:, None] * p + torch.arange(p, device=k.device))  # [B, P]
    page = state.block_table[bi, n.clamp(max=state.block_table.shape[1] - 1)].long()  # [B]
    for x, fmt, clip, levels, codes, params, operand in _demotions(state, layout, transform):
        rows_x = x[bi[:, None], :, rows].permute(0, 2, 1, 3)  # [B, H_kv, P, D]
        qc, qp = quantize_pages(rows_x, fmt, clip, levels, operand)
        codes[page] = torch.where(due.view(-1, 1, 1, 1), qc, codes[page])
        params[page] = torch.where(due.view(-1, *([1] * (qp.dim() - 1))), qp, params[page])
    # the token
    sink_pos = state.sink_len.long().clamp(max=max(s0 - 1, 0))
    slot = layout.recent_slot(n * p + state.recent_len.long())
    for buf_s, buf_r, x in ((state.sink_k, state.recent_k, k), (state.sink_v, state.recent_v, v)):
        if s0 > 0:
            old = buf_s[bi, :, sink_pos]  # [B, H_kv, D]
            buf_s[bi, :, sink_pos] = torch.where((ok & to_sink).view(-1, 1, 1), x.to(buf_s.dtype), old)
        old = buf_r[bi, :, slot]
        buf_r[bi, :, slot] = torch.where((ok & ~to_sink).view(-1, 1, 1), x.to(buf_r.dtype), old)


def _demotions(state: PagedKV, layout: KVCacheLayout, transform: LayerTransform) -> tuple:
    """``(recent ring, row format, clip, levels, codes pool, params pool, operand)`` of K, then of V."""
    return (
        (state.recent_k, layout.key, transform.k_clip, transform.k_levels, state.k_codes, state.k_params, "key"),
        (state.recent_v, layout.value, transform.v_clip, transform.v_levels, state.v_codes, state.v_params, "value"),
    )


# ---- the decode step in eager host code (the CPU path): the same bytes and tensors, host reads allowed -----------


def decode_append_host(
    state: PagedKV, k: torch.Tensor, v: torch.Tensor, status: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform,
) -> None:
    """:func:`decode_append` with the lengths and the status read on the host: each slot that writes stores its
    token and, only when one is due, its page (the branch-free form computes every slot's candidate page every
    step). The same bytes as :func:`decode_append` (test); arguments as there."""
    from .pages import STATUS_NONFINITE

    finite = torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1)
    status.bitwise_or_((~finite).to(torch.int32) * STATUS_NONFINITE)
    p, s0, m = layout.page_size, layout.sink, state.block_table.shape[1]
    host = torch.stack([status, state.sink_len, state.num_pages, state.recent_len]).tolist()  # [4][B]
    for b, (st, sink_len, n, recent_len) in enumerate(zip(*host)):
        if st != 0:
            continue
        if sink_len < s0:
            state.sink_k[b, :, sink_len] = k[b]
            state.sink_v[b, :, sink_len] = v[b]
            continue
        if recent_len == layout.recent_capacity:  # the oldest P recent tokens become page n
            page = int(state.block_table[b, min(n, m - 1)])
            slots = layout.recent_slot(torch.arange(n * p, n * p + p, device=k.device))
            for x, fmt, clip, levels, codes, params, operand in _demotions(state, layout, transform):
                qc, qp = quantize_pages(x[b][:, slots][None], fmt, clip, levels, operand)  # of [1, H_kv, P, D]
                codes[page], params[page] = qc[0], qp[0]
        slot = layout.recent_slot(n * p + recent_len)
        state.recent_k[b, :, slot] = k[b]
        state.recent_v[b, :, slot] = v[b]


def gather_context_memo(
    state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor, memo: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gather_context` kept up to date in ``memo`` between calls (one layer's dict, empty at first).

    The memo holds the last call's dense K and V and the codes and params they were dequantized from. A call
    dequantizes again only the page slots whose codes or params changed (in a decode step: the page demoted
    since the last one, or none) and copies the sink and the recent ring in, instead of building every tensor
    anew. It returns the memo's own buffers, equal to :func:`gather_context`'s (each page is the same
    elementwise dequantization: test) and valid until the next call. Reads on the host: not under graph capture.
    """
    b, m = state.block_table.shape
    p, s0, c = layout.page_size, layout.sink, layout.recent_slots
    ids = state.block_table.long().clamp(0, state.k_codes.shape[0] - 1)
    pages = (state.k_codes[ids], state.k_params[ids], state.v_codes[ids], state.v_params[ids])  # [B, M, ...]
    old = memo.get("pages")
    shape = (b, layout.num_kv_heads, s0 + m * p + c, layout.head_dim)
    if old is None or memo["k"].shape != shape or any(x.shape != y.shape for x, y in zip(pages, old)):
        k, v, valid = gather_context(state, layout, k_levels, v_levels)
        memo.update(pages=pages, k=k, v=v)
        return k, v, valid
    k, v = memo["k"], memo["v"]
    if not all(torch.equal(x, y) for x, y in zip(pages, old)):
        changed = torch.zeros(b, m, dtype=torch.bool, device=ids.device)
        for x, y in zip(pages, old):
            changed |= (x != y).flatten(2).any(2)
        kc, kp, vc, vp = (x[changed] for x in pages)  # [n, H_kv, ...]
        k[:, :, s0 : s0 + m * p].unflatten(2, (m, p)).transpose(1, 2)[changed] = dequantize_pages(
            kc, kp, layout.key, k_levels)  # the page slots as [B, M, H_kv, P, D] (a view)
        v[:, :, s0 : s0 + m * p].unflatten(2, (m, p)).transpose(1, 2)[changed] = dequantize_pages(
            vc, vp, layout.value, v_levels, "value")
        memo["pages"] = pages
    for dense, sink, recent in ((k, state.sink_k, state.recent_k), (v, state.sink_v, state.recent_v)):
        dense[:, :, :s0] = sink
        dense[:, :, s0 + m * p :] = recent
    return k, v, context_mask(state, layout)


__all__ = [
    "append_tokens",
    "check_finite",
    "chunk_attention",
    "clip_threshold",
    "decode_append",
    "decode_attention",
    "dequantize_groups",
    "decode_append_host",
    "dequantize_pages",
    "context_mask",
    "gather_context",
    "gather_context_memo",
    "masked_attention",
    "mma16_group",
    "pack_codes",
    "pack_mma16",
    "pack_page_codes",
    "quantize_groups",
    "span_inverse",
    "quantize_pages",
    "read_sequence",
    "recent_valid",
    "unpack_codes",
    "unpack_mma16",
    "unpack_page_codes",
    "write_pages",
    "write_tokens",
]
