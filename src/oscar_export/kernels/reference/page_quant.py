"""Whole pages of one row format (token or channel groups, 2- or 4-bit codes, linear or mma16 packing):
:func:`quantize_pages` and its inverse :func:`dequantize_pages`, the definition the Triton quantizer
(``kernels/quant_pack.py``) matches bit for bit."""

from __future__ import annotations

import torch

from ..layout import RowFormat
from ..transform import clip_rank
from .groups import dequantize_groups, quantize_groups
from .packing import pack_page_codes, unpack_page_codes


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
