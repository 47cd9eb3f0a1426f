"""What the bytes mean: the readable PyTorch definition of every cache op.

This is the test oracle for the Triton kernels and the ``torch.compile`` path of the Hugging Face
integration. The pure functions (pack, quantize, dequantize, attention) are static-shape and free of
``.item()`` and value-dependent branching, so they compile with ``torch.compile(fullgraph=True)``. The
cache writers (``append_tokens``, ``demote``) are host-side bookkeeping around them.

Quantization of one group ``x`` (DESIGN §3.1), bit-exact in every implementation:

    thr   = sorted(|x|)[rank]                      rank = clip_rank(ratio, len(x)); ratio 1 -> max
    xc    = clamp(x, -thr, thr)
    scale = fp16((max(xc) - min(xc)) * fp32(1/3));  lo = fp16(min(xc))
    d     = xc - float(lo)
    code  = [d >= t0 * s] + [d >= t1 * s] + [d >= t2 * s],  t_j = (levels[j] + levels[j+1]) / 2, s = float(scale)
    x_hat = float(lo) + float(scale) * levels[code]

No division anywhere, so torch and Triton agree to the bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from .layout import CODES_PER_BYTE, ONE_THIRD_F32, KVCacheLayout, PagedKV, RowFormat
from .transform import LayerTransform, clip_rank

# ---- packing ------------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[..., D]`` uint8 codes in 0..3 -> ``[..., D // 4]`` uint8.

    Within each group of ``G`` elements, byte ``b`` holds elements ``b, b+G/4, b+G/2, b+3G/4`` at bits 0, 2, 4, 6.
    """
    *lead, d = codes.shape
    c = codes.to(torch.uint8).reshape(*lead, d // group_size, CODES_PER_BYTE, group_size // CODES_PER_BYTE)
    packed = c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)
    return packed.reshape(*lead, d // CODES_PER_BYTE)


def unpack_codes(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[..., D // 4]`` uint8 -> ``[..., D]`` uint8 codes in 0..3 (inverse of :func:`pack_codes`)."""
    *lead, nb = packed.shape
    q = group_size // CODES_PER_BYTE
    p = packed.reshape(*lead, nb // q, 1, q)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device).view(4, 1)
    c = (p >> shifts) & 3  # [..., D/G, 4, G/4]
    return c.reshape(*lead, nb * CODES_PER_BYTE)


# ---- one quantization group along the last axis ----------------------------------------------------------


def quantize_groups(
    x: torch.Tensor, rank: torch.Tensor, levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups along the last axis.

    Args:
        x: ``[..., n]`` float32 (the group is the last axis).
        rank: long, broadcastable to ``[..., 1]``: clip rank (see :func:`clip_rank`).
        levels: ``[..., 4]`` float32 broadcastable, ascending code levels.
    Returns:
        codes ``[..., n]`` uint8, scale ``[...]`` fp16, lo ``[...]`` fp16.
    """
    x = x.float()
    srt = x.abs().sort(dim=-1).values
    thr = torch.gather(srt, -1, rank.expand(*x.shape[:-1], 1))
    xc = torch.minimum(torch.maximum(x, -thr), thr)
    lo = xc.amin(dim=-1, keepdim=True)
    hi = xc.amax(dim=-1, keepdim=True)
    scale16 = ((hi - lo) * ONE_THIRD_F32).to(torch.float16)
    lo16 = lo.to(torch.float16)
    s = scale16.float()
    d = xc - lo16.float()
    lv = levels.float()
    t = (lv[..., :-1] + lv[..., 1:]) * 0.5  # [..., 3]
    codes = (
        (d >= t[..., 0:1] * s).to(torch.uint8)
        + (d >= t[..., 1:2] * s).to(torch.uint8)
        + (d >= t[..., 2:3] * s).to(torch.uint8)
    )
    return codes, scale16.squeeze(-1), lo16.squeeze(-1)


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, levels: torch.Tensor
) -> torch.Tensor:
    """``lo + scale * levels[code]`` in float32; ``codes [..., n]``, ``scale``/``lo`` ``[...]``, ``levels [..., 4]``."""
    lv = levels.float().expand(*codes.shape[:-1], 4)
    val = torch.gather(lv, -1, codes.long())
    return lo.float().unsqueeze(-1) + scale.float().unsqueeze(-1) * val


# ---- pages ------------------------------------------------------------------------------------------------------


def quantize_pages(
    x: torch.Tensor, fmt: RowFormat, clip: torch.Tensor, levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize whole pages of rows already in the stored basis.

    Args:
        x: ``[N, H_kv, P, D]`` float.
        fmt: row format (token or channel granularity).
        clip: ``[H_kv]`` clip ratios.
        levels: ``[H_kv, 4]`` code levels.
    Returns:
        codes ``[N, H_kv, P, D // 4]`` uint8 and params fp16 (``[N, H_kv, P, D // G, 2]`` token,
        ``[N, H_kv, 2, D]`` channel).
    """
    n, h, p, d = x.shape
    if fmt.granularity == "token":
        g = fmt.group_size
        rank = clip_rank(clip.to(x.device), g).view(1, h, 1, 1, 1)
        codes, scale, lo = quantize_groups(x.reshape(n, h, p, d // g, g), rank, levels.view(1, h, 1, 1, 4))
        return pack_codes(codes.reshape(n, h, p, d), g), torch.stack([scale, lo], dim=-1)
    rank = clip_rank(clip.to(x.device), p).view(1, h, 1, 1)
    codes, scale, lo = quantize_groups(x.transpose(-1, -2), rank, levels.view(1, h, 1, 4))  # [N, H, D, P]
    codes = codes.transpose(-1, -2)
    return pack_codes(codes, fmt.group_size), torch.stack([scale, lo], dim=-2)


def dequantize_pages(
    codes: torch.Tensor, params: torch.Tensor, fmt: RowFormat, levels: torch.Tensor
) -> torch.Tensor:
    """Inverse of :func:`quantize_pages`: ``[..., H_kv, P, D // 4]`` -> ``[..., H_kv, P, D]`` float32.

    Leading dims are free (``[N]`` for the pool, ``[B, M]`` for gathered block tables); ``levels [H_kv, 4]``.
    """
    c = unpack_codes(codes, fmt.group_size)  # [..., H, P, D]
    *lead, h, p, d = c.shape
    if fmt.granularity == "token":
        g = fmt.group_size
        lv = levels.view(*([1] * len(lead)), h, 1, 1, 4)
        out = dequantize_groups(c.reshape(*lead, h, p, d // g, g), params[..., 0], params[..., 1], lv)
        return out.reshape(*lead, h, p, d)
    lv = levels.view(*([1] * len(lead)), h, 1, 4)
    out = dequantize_groups(c.transpose(-1, -2), params[..., 0, :], params[..., 1, :], lv)
    return out.transpose(-1, -2)


# ---- attention over the mixed-precision cache -------------------------------------------------------------


def gather_context(
    state: PagedKV, layout: KVCacheLayout, k_levels: torch.Tensor, v_levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's cache as dense float32 ``[B, H_kv, S0 + M*P + W + P, D]`` K and V and a ``[B, T]`` mask.

    Order along T: sink slots, then the ``M = block_table.shape[1]`` page slots, then the recent slots;
    the mask marks the slots a sequence actually holds.
    """
    b, m = state.block_table.shape
    p = layout.page_size
    pool = state.k_codes.shape[0]
    ids = state.block_table.long().clamp(0, pool - 1)  # entries past num_pages are masked below
    k_hist = dequantize_pages(state.k_codes[ids], state.k_params[ids], layout.key, k_levels)  # [B, M, H, P, D]
    v_hist = dequantize_pages(state.v_codes[ids], state.v_params[ids], layout.value, v_levels)
    h, d = layout.num_kv_heads, layout.head_dim
    k_hist = k_hist.permute(0, 2, 1, 3, 4).reshape(b, h, m * p, d)
    v_hist = v_hist.permute(0, 2, 1, 3, 4).reshape(b, h, m * p, d)
    k = torch.cat([state.sink_k.float(), k_hist, state.recent_k.float()], dim=2)
    v = torch.cat([state.sink_v.float(), v_hist, state.recent_v.float()], dim=2)
    dev = state.block_table.device
    valid = torch.cat(
        [
            torch.arange(layout.sink, device=dev)[None, :] < state.sink_len[:, None],
            torch.arange(m * p, device=dev)[None, :] < (state.num_pages[:, None] * p),
            torch.arange(layout.recent_capacity, device=dev)[None, :] < state.recent_len[:, None],
        ],
        dim=1,
    )
    return k, v, valid


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
) -> torch.Tensor:
    """One decode step over sink + INT2 pages + recent, in the stored basis.

    Args:
        q: ``[B, H, D]`` queries already in the stored key basis (``LayerTransform.transform_queries``).
        state: the layer's cache, the new token already appended.
    Returns:
        ``[B, H, D]`` float32 in the stored value basis (``LayerTransform.restore_output`` undoes it).
    """
    k, v, valid = gather_context(state, layout, k_levels, v_levels)
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
        ``[B, H, Tq, D]`` float32, stored value basis.
    """
    k, v, valid = gather_context(state, layout, k_levels, v_levels)
    tq = q.shape[2]
    causal = torch.ones(tq, tq, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([valid[:, None, :].expand(-1, tq, -1), causal[None].expand(q.shape[0], -1, -1)], dim=2)
    return masked_attention(q, torch.cat([k, k_new.float()], 2), torch.cat([v, v_new.float()], 2), mask, scale)


# ---- cache writers (host-side bookkeeping around the pure ops) --------------------------------------------


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise if ``x`` holds NaN or Inf: one would silently turn a whole page into garbage."""
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"{what}: {bad} non-finite values (NaN/Inf) would enter the cache")


def demote(
    state: PagedKV, b: int, page_id: int, layout: KVCacheLayout, transform: LayerTransform,
    write: Callable | None = None,
) -> None:
    """Quantize the oldest ``P`` recent tokens of sequence ``b`` into page ``page_id`` and shift recent left.

    ``write`` has :func:`write_pages`' signature (the default); a backend passes its own page quantizer.
    """
    write = write or write_pages
    p = layout.page_size
    n = int(state.num_pages[b])
    if int(state.recent_len[b]) < p:
        raise RuntimeError(f"demote: sequence {b} holds {int(state.recent_len[b])} recent tokens, needs {p}")
    if n >= state.block_table.shape[1]:
        raise ValueError(f"demote: sequence {b} already uses all {n} block-table slots")
    # [1, H_kv, P, D] in the window's dtype (the quantizer computes in fp32)
    write(state, [page_id], state.recent_k[b : b + 1, :, :p], state.recent_v[b : b + 1, :, :p], layout, transform)
    state.block_table[b, n] = page_id
    state.num_pages[b] = n + 1
    state.recent_k[b, :, :-p] = state.recent_k[b, :, p:].clone()
    state.recent_v[b, :, :-p] = state.recent_v[b, :, p:].clone()
    state.recent_len[b] -= p


def write_pages(
    state: PagedKV, page_ids: list[int], k: torch.Tensor, v: torch.Tensor, layout: KVCacheLayout,
    transform: LayerTransform,
) -> None:
    """Quantize ``k, v [N, H_kv, P, D]`` (stored basis) into the pool pages ``page_ids``."""
    kc, kp = quantize_pages(k, layout.key, transform.k_clip, transform.k_levels)
    vc, vp = quantize_pages(v, layout.value, transform.v_clip, transform.v_levels)
    idx = torch.tensor(page_ids, dtype=torch.long, device=state.k_codes.device)
    state.k_codes.index_copy_(0, idx, kc)
    state.k_params.index_copy_(0, idx, kp)
    state.v_codes.index_copy_(0, idx, vc)
    state.v_params.index_copy_(0, idx, vp)


def append_tokens(
    state: PagedKV,
    b: int,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: KVCacheLayout,
    transform: LayerTransform,
    allocate: Callable[[], int],
    write: Callable | None = None,
) -> None:
    """Append ``T`` tokens to sequence ``b``: sink first, then recent, demoting ``P`` at a time when full.

    Args:
        k, v: ``[H_kv, T, D]`` already in the stored basis.
        allocate: returns a free page id (raises when the pool is full).
        write: page quantizer with :func:`write_pages`' signature (default); backends pass their kernel.
    Sequences are written whole pages at a time when the history is known up front (prefill), so a
    T-token prefill and T single-token appends leave identical caches.
    """
    write = write or write_pages
    check_finite(k, "keys")
    check_finite(v, "values")
    t = k.shape[1]
    i = 0
    s0 = int(state.sink_len[b])
    if s0 < layout.sink and int(state.recent_len[b]) == 0 and int(state.num_pages[b]) == 0:
        n = min(layout.sink - s0, t)
        state.sink_k[b, :, s0 : s0 + n] = k[:, :n].to(state.sink_k.dtype)
        state.sink_v[b, :, s0 : s0 + n] = v[:, :n].to(state.sink_v.dtype)
        state.sink_len[b] = s0 + n
        i = n
    cap, p = layout.recent_capacity, layout.page_size
    while i < t:
        r = int(state.recent_len[b])
        if r == cap:
            demote(state, b, allocate(), layout, transform, write)
            continue
        # Bulk path: whole pages that will certainly be demoted go straight to INT2 (same bytes as the loop).
        if r == 0 and t - i > cap:
            full = -(-(t - i - cap) // p)  # = layout.split: recent ends with W+1..W+P tokens
            n_pg = int(state.num_pages[b])
            if n_pg + full > state.block_table.shape[1]:
                raise ValueError(f"append: sequence {b} needs more than {state.block_table.shape[1]} pages")
            ids = [allocate() for _ in range(full)]
            h, d = k.shape[0], k.shape[2]
            # Rows pass through the recent buffer's dtype first, exactly as the one-by-one path does.
            kk = k[:, i : i + full * p].to(state.recent_k.dtype).reshape(h, full, p, d).transpose(0, 1).contiguous()
            vv = v[:, i : i + full * p].to(state.recent_v.dtype).reshape(h, full, p, d).transpose(0, 1).contiguous()
            write(state, ids, kk, vv, layout, transform)
            state.block_table[b, n_pg : n_pg + full] = torch.tensor(ids, dtype=torch.int32)
            state.num_pages[b] = n_pg + full
            i += full * p
            continue
        n = min(cap - r, t - i)
        state.recent_k[b, :, r : r + n] = k[:, i : i + n].to(state.recent_k.dtype)
        state.recent_v[b, :, r : r + n] = v[:, i : i + n].to(state.recent_v.dtype)
        state.recent_len[b] = r + n
        i += n


def sequence_pages(state: PagedKV, b: int) -> list[int]:
    """Page ids held by sequence ``b`` (to free them)."""
    return state.block_table[b, : int(state.num_pages[b])].tolist()


def reset_sequence(state: PagedKV, b: int) -> None:
    """Forget sequence ``b`` (its pages must be returned to the allocator by the caller)."""
    state.sink_len[b] = 0
    state.num_pages[b] = 0
    state.recent_len[b] = 0


__all__ = [
    "append_tokens",
    "check_finite",
    "chunk_attention",
    "decode_attention",
    "demote",
    "dequantize_groups",
    "dequantize_pages",
    "gather_context",
    "masked_attention",
    "pack_codes",
    "quantize_groups",
    "quantize_pages",
    "reset_sequence",
    "sequence_pages",
    "unpack_codes",
    "write_pages",
]
