"""How codes sit in bytes: the linear packing (:func:`pack_codes`), the ``mma16`` fragment order
(:func:`pack_mma16`, ``RowFormat.packing == "mma16"``) and whole pages in their row format's packing
(:func:`pack_page_codes`). Each ``pack_*`` has its exact inverse ``unpack_*``."""

from __future__ import annotations

import torch

from ..layout import RowFormat

# ---- the linear packing ---------------------------------------------------------------------------------------------


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
