"""The KV-cache methods the evaluation compares, and what each one's cache holds for every query position.

Decode-as-deployed (DESIGN §5): the query at absolute position ``a`` reads the cache as it stands after
token ``a`` was appended. Each method says, per query position, which tokens it reads quantized (INT2,
dequantized) and which at full precision:

``full``   BF16: every token full precision (stored in ``store_dtype``).
``pages``  the OSCAR layout (naive INT2, QuaRot, the research recipe, ours): ``layout.split(a + 1)`` gives
           ``(sink, pages, recent)``; token ``j`` is INT2 iff ``S0 <= j < S0 + pages * P``. Page grouping is
           absolute, so every page is quantized once (``kernels.reference.quantize_pages``, the real row
           format and ``LayerTransform``) and each query row picks quantized or full keys/values.
``kivi``   KIVI-2 (arXiv 2402.02750): keys per channel in groups of ``group`` tokens, flushed from a
           full-precision residual every ``residual`` tokens (key ``j`` INT2 iff ``j < floor((a+1)/R)*R``);
           values per token in groups of ``group`` channels, INT2 once older than the last ``R`` tokens.
           fp16 scale and minimum per group, round to nearest (the reference quantizer with no clipping).
``hf``     transformers' ``QuantizedCache`` (HQQ or quanto backend): the real backend layer's ``_quantize`` /
           ``_dequantize`` and its ``update`` rule replayed: the first update (``prefill_len`` tokens) is
           quantized whole, later tokens wait in a residual until ``residual + 1 >= R``, then *everything*
           (dequantized history + residual) is quantized again. Queries between two flushes read the same
           quantized state, so the state is rebuilt once per flush (``Segment``).

Every stored row (full precision or quantized source) is rounded to ``store_dtype`` first, as the real
caches store BF16 rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.reference import dequantize_groups, dequantize_pages, quantize_groups, quantize_pages
from oscar_export.kernels.transform import LayerTransform, clip_rank

KINDS = ("full", "pages", "kivi", "hf")
HF_BACKENDS = ("hqq", "quanto")
PARAM_DTYPES = ("float16", "float32")


@dataclass(frozen=True, eq=False)
class Method:
    """One cache method.

    Args:
        name: short id used in tables and JSON.
        kind: one of ``KINDS``.
        description: one line for the report.
        layout: ``pages``: the cache layout (windows, page size, row formats).
        transforms: ``pages``: one ``LayerTransform`` per layer.
        param_dtype: ``pages``: ``"float16"`` (our format, the reference quantizer bit-exactly) or ``"float32"``
            (the research code's fp32 scale and minimum; token granularity only).
        group: ``kivi``: tokens per key group and channels per value group.
        residual: ``kivi``/``hf``: R, the full-precision residual length.
        backend: ``hf``: ``"hqq"`` or ``"quanto"``.
        hf_group: ``hf``: ``q_group_size`` of ``QuantizedCache``.
        quantize: False reads every token at full precision (the transform still applies): the BF16 check.
        noise: replace every dequantized value by Gaussian noise of the same per-head mean and std (tests
            that the quantized path is what gets scored).
    """

    name: str
    kind: str
    description: str = ""
    layout: KVCacheLayout | None = None
    transforms: tuple[LayerTransform, ...] = ()
    param_dtype: str = "float16"
    group: int = 32
    residual: int = 128
    backend: str = ""
    hf_group: int = 64
    quantize: bool = True
    noise: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "transforms", tuple(self.transforms))
        if self.kind not in KINDS:
            raise ValueError(f"Method.kind: expected one of {KINDS}, got {self.kind!r}")
        if self.kind == "pages":
            if self.layout is None or not self.transforms:
                raise ValueError(f"Method {self.name!r}: kind 'pages' needs a layout and per-layer transforms")
            if self.param_dtype not in PARAM_DTYPES:
                raise ValueError(f"Method.param_dtype: expected one of {PARAM_DTYPES}, got {self.param_dtype!r}")
            if self.param_dtype == "float32" and self.layout.key.granularity != "token":
                raise NotImplementedError("Method: float32 params are implemented for token-granular keys only")
            for i, t in enumerate(self.transforms):
                if t.num_kv_heads != self.layout.num_kv_heads or t.head_dim != self.layout.head_dim:
                    raise ValueError(
                        f"Method {self.name!r}: transform {i} is [{t.num_kv_heads}, {t.head_dim}], "
                        f"layout is [{self.layout.num_kv_heads}, {self.layout.head_dim}]"
                    )
        if self.kind == "kivi" and (self.group <= 0 or self.residual <= 0 or self.residual % self.group):
            raise ValueError(f"Method {self.name!r}: KIVI residual must be a positive multiple of group, got "
                             f"group={self.group}, residual={self.residual}")
        if self.kind == "hf" and self.backend not in HF_BACKENDS:
            raise ValueError(f"Method.backend: expected one of {HF_BACKENDS}, got {self.backend!r}")

    # ---- what a query at absolute position ``a`` reads quantized -------------------------------------------
    def int2_ranges(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lo, k_hi, v_hi)`` long ``[Tq]``: keys ``[lo, k_hi)`` and values ``[lo, v_hi)`` are INT2 for query ``pos``.

        ``hf`` is not expressible per position (its state depends on the flush history): see ``hf_segments``.
        """
        n = pos + 1
        zero = torch.zeros_like(pos)
        if self.kind == "full" or not self.quantize:
            return zero, zero, zero
        if self.kind == "pages":
            lay = self.layout
            rest = (n - lay.sink).clamp(min=0)
            pages = torch.div(rest - lay.recent_capacity + lay.page_size - 1, lay.page_size,
                              rounding_mode="floor").clamp(min=0)
            lo = torch.full_like(pos, lay.sink)
            hi = lo + pages * lay.page_size
            return lo, hi, hi
        if self.kind == "kivi":
            k_hi = torch.div(n, self.residual, rounding_mode="floor") * self.residual
            return zero, k_hi, (n - self.residual).clamp(min=0)
        raise NotImplementedError(f"Method {self.name!r}: kind {self.kind!r} has no per-position rule")

    # ---- bits ----------------------------------------------------------------------------------------------
    def bits_per_element(self, length: int) -> float:
        """Stored bits per K/V element of a ``length``-token sequence fed token by token (windows included).

        ``pages``: from the layout (fp16 params) or the same layout with 32-bit params. ``kivi``: 2-bit codes +
        fp16 scale and minimum per group. ``hf``: 2-bit codes + a 16-bit scale and zero point per group of
        ``hf_group`` (as in a BF16/FP16 deployment; HQQ and quanto keep params in the compute dtype),
        full-precision residual at 16 bits.
        """
        if length <= 0:
            raise ValueError(f"length: expected > 0, got {length}")
        if self.kind == "full" or not self.quantize:
            return 16.0
        if self.kind == "pages":
            lay = self.layout
            if self.param_dtype == "float16":
                return lay.effective_bits_per_element(length)
            sink, pages, recent = lay.split(length)
            int2 = 2.0 + 2 * 32.0 / lay.key.group_size  # fp32 (scale, lo) per G elements, K and V alike
            q = pages * lay.page_size
            return ((sink + recent) * 16.0 + q * int2) / length
        if self.kind == "kivi":
            per = 2.0 + 2 * 16.0 / self.group
            kq = (length // self.residual) * self.residual
            vq = max(0, length - self.residual)
            return ((kq + vq) * per + (2 * length - kq - vq) * 16.0) / (2 * length)
        per = 2.0 + 2 * 16.0 / self.hf_group
        q = hf_quantized_count(1, length, self.residual)
        return (q * per + (length - q) * 16.0) / length


def hf_quantized_count(prefill_len: int, length: int, residual: int) -> int:
    """Tokens held quantized by ``QuantizedCache`` after a ``prefill_len`` update then single-token updates."""
    return hf_flushes(prefill_len, length, residual)[-1][1] if length > prefill_len else min(prefill_len, length)


def hf_flushes(prefill_len: int, length: int, residual: int) -> list[tuple[int, int]]:
    """``[(first query position, quantized count)]``: the cache states a ``length``-token sequence goes through.

    State 0 is the prefill: ``prefill_len`` tokens quantized, read by queries from ``prefill_len`` on (the
    prefill queries themselves attend at full precision). The query at which the residual fills still reads
    the old state; the flush takes effect from the next position.
    """
    states = [(prefill_len, prefill_len)]
    res = 0
    for a in range(prefill_len, length):
        if res + 1 >= residual:
            states.append((a + 1, a + 1))
            res = 0
        else:
            res += 1
    return states


# ---- quantizers --------------------------------------------------------------------------------------------


def _fp32_quant_dequant(x: torch.Tensor, rank: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The reference group quantizer with fp32 (not fp16) scale and minimum (the research code's storage)."""
    srt = x.abs().sort(dim=-1).values
    thr = torch.gather(srt, -1, rank.expand(*x.shape[:-1], 1))
    xc = torch.minimum(torch.maximum(x, -thr), thr)
    lo = xc.amin(dim=-1, keepdim=True)
    s = (xc.amax(dim=-1, keepdim=True) - lo) * (1.0 / 3.0)
    d = xc - lo
    lv = levels.float()
    t = (lv[..., :-1] + lv[..., 1:]) * 0.5
    codes = (d >= t[..., 0:1] * s).long() + (d >= t[..., 1:2] * s).long() + (d >= t[..., 2:3] * s).long()
    return lo + s * torch.gather(lv.expand(*codes.shape[:-1], 4), -1, codes)


def quant_dequant_pages(x: torch.Tensor, method: Method, transform: LayerTransform, side: str) -> torch.Tensor:
    """``[H_kv, N*P, D]`` stored-basis rows of whole pages -> dequantized rows (float32), exactly as the cache."""
    lay = method.layout
    h, t, d = x.shape
    n = t // lay.page_size
    pages = x.reshape(h, n, lay.page_size, d).transpose(0, 1)  # [N, H_kv, P, D]
    fmt = lay.key if side == "k" else lay.value
    clip = transform.k_clip if side == "k" else transform.v_clip
    levels = transform.k_levels if side == "k" else transform.v_levels
    if method.param_dtype == "float16":
        codes, params = quantize_pages(pages, fmt, clip, levels)
        out = dequantize_pages(codes, params, fmt, levels)
    else:
        g = fmt.group_size
        rank = clip_rank(clip, g).view(1, h, 1, 1, 1)
        out = _fp32_quant_dequant(pages.reshape(n, h, lay.page_size, d // g, g), rank, levels.view(1, h, 1, 1, 4))
        out = out.reshape(n, h, lay.page_size, d)
    return out.transpose(0, 1).reshape(h, t, d)


def kivi_keys(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[H_kv, T, D]`` (T a multiple of ``group``): per channel over ``group`` tokens, fp16 params, RTN."""
    h, t, d = x.shape
    g = x.reshape(h, t // group, group, d).transpose(-1, -2)  # [H, T/g, D, g]
    return _minmax_rtn(g).transpose(-1, -2).reshape(h, t, d)


def kivi_values(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[H_kv, T, D]``: per token over ``group`` channels, fp16 params, RTN."""
    h, t, d = x.shape
    if d % group:
        raise ValueError(f"KIVI: head_dim {d} is not a multiple of the group size {group}")
    return _minmax_rtn(x.reshape(h, t, d // group, group)).reshape(h, t, d)


def _minmax_rtn(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric min-max 2-bit round-to-nearest with fp16 params along the last axis (no clipping)."""
    n = x.shape[-1]
    rank = torch.full((1,), n - 1, dtype=torch.long, device=x.device)
    levels = torch.tensor([0.0, 1.0, 2.0, 3.0], device=x.device)
    codes, scale, lo = quantize_groups(x.float(), rank, levels)
    return dequantize_groups(codes, scale, lo, levels)


def hf_backend_layer(method: Method, like: torch.Tensor):
    """The real transformers ``QuantizedLayer`` of ``method.backend``, 2 bits, lazily initialised on ``like``."""
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = HQQQuantizedLayer if method.backend == "hqq" else QuantoQuantizedLayer
    layer = cls(nbits=2, q_group_size=method.hf_group, residual_length=method.residual)
    layer.lazy_initialization(like, like)
    return layer


def add_noise_like(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Gaussian noise with the per-head mean and std of ``x [H_kv, T, D]`` (deterministic)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.device)
    mean = x.mean(dim=(1, 2), keepdim=True)
    std = x.std(dim=(1, 2), keepdim=True)
    return mean + std * z


# ---- what one layer reads ----------------------------------------------------------------------------------


@dataclass
class Segment:
    """Queries at positions ``[start, end)`` read ``k_alt``/``v_alt`` (dequantized rows ``[H_kv, c1 - c0, D]``
    covering token positions ``[c0, c1)``) where ``ranges`` says so, and the full-precision rows elsewhere."""

    start: int
    end: int
    c0: int = 0
    k_alt: torch.Tensor | None = None
    v_alt: torch.Tensor | None = None
    ranges: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


@dataclass
class Prepared:
    """One layer of one sequence under one method: stored-basis rows and the segments that read them."""

    transform: LayerTransform | None
    ks: torch.Tensor  # [H_kv, Tk, D] float32, full-precision stored rows
    vs: torch.Tensor
    segments: list[Segment] = field(default_factory=list)


def stored_rows(method: Method, layer: int, k: torch.Tensor, v: torch.Tensor, store_dtype: torch.dtype):
    """``k, v [H_kv, T, D]`` model basis -> ``(transform, ks, vs)`` stored basis, rounded to ``store_dtype``."""
    t = method.transforms[layer] if method.kind == "pages" else None
    if t is None:
        return None, k.to(store_dtype).float(), v.to(store_dtype).float()
    ks = t.transform_keys(k.unsqueeze(0))[0]
    vs = t.transform_values(v.unsqueeze(0))[0]
    return t, ks.to(store_dtype).float(), vs.to(store_dtype).float()


def prepare(method: Method, layer: int, ks: torch.Tensor, vs: torch.Tensor, q_start: int, q_end: int,
            prefill_len: int, transform: LayerTransform | None) -> list[Segment]:
    """The segments for queries at positions ``[q_start, q_end)`` over stored rows ``ks, vs [H_kv, n, D]``.

    Quantized rows are computed for every whole group the ``n`` rows hold (pages: every whole page after the
    sink; KIVI: every whole key group, every value row), whether or not a query reads them yet: page and
    group boundaries are absolute, so a row's quantized value does not depend on when it is read, and
    ``ranges`` selects what each query position actually reads. ``hf`` replays the cache states instead.
    """
    n = ks.shape[1]
    if method.kind == "full" or not method.quantize:
        return [Segment(q_start, q_end)]
    if method.kind == "pages":
        lay = method.layout
        c0 = lay.sink
        c1 = c0 + max(0, n - c0) // lay.page_size * lay.page_size
        if c1 <= c0:
            return [Segment(q_start, q_end)]
        k_alt = quant_dequant_pages(ks[:, c0:c1], method, transform, "k")
        v_alt = quant_dequant_pages(vs[:, c0:c1], method, transform, "v")
        return [_noisy(Segment(q_start, q_end, c0, k_alt, v_alt, method.int2_ranges), method, layer)]
    if method.kind == "kivi":
        kq = n // method.group * method.group
        if n == 0:
            return [Segment(q_start, q_end)]
        k_alt = torch.zeros(ks.shape[0], n, ks.shape[2])
        k_alt[:, :kq] = kivi_keys(ks[:, :kq], method.group)
        v_alt = kivi_values(vs, method.group)
        return [_noisy(Segment(q_start, q_end, 0, k_alt, v_alt, method.int2_ranges), method, layer)]
    return _hf_segments(method, layer, ks, vs, q_start, q_end, prefill_len)


def covers(method: Method, segs: list[Segment], q_end: int, prefill_len: int) -> bool:
    """Whether ``segs`` (prepared from fewer rows) still give every query in ``[.., q_end)`` what it reads."""
    if method.kind == "full" or not method.quantize:
        return True
    if method.kind == "hf":
        return q_end - prefill_len <= method.residual - 1  # no flush since the prompt
    seg = segs[-1]
    if seg.k_alt is None:
        return method.int2_ranges(torch.tensor([q_end - 1]))[1].item() <= seg.c0
    lo, k_hi, v_hi = method.int2_ranges(torch.tensor([q_end - 1]))
    extent = seg.c0 + seg.k_alt.shape[1]
    if method.kind == "kivi":
        kq = extent // method.group * method.group
        return k_hi.item() <= kq and v_hi.item() <= extent
    return max(k_hi.item(), v_hi.item()) <= extent


def _noisy(seg: Segment, method: Method, layer: int) -> Segment:
    if method.noise:
        seg.k_alt = add_noise_like(seg.k_alt, 2 * layer)
        seg.v_alt = add_noise_like(seg.v_alt, 2 * layer + 1)
    return seg


def _hf_segments(method: Method, layer: int, ks, vs, q_start: int, q_end: int, prefill_len: int) -> list[Segment]:
    """Replay ``QuantizedLayer.update`` with the real backend quantizer; one segment per cache state."""
    tk = q_end
    x_k, x_v = ks.unsqueeze(0), vs.unsqueeze(0)  # [1, H_kv, Tk, D], the layout HF's layers quantize
    hl = hf_backend_layer(method, x_k[:, :, :1])
    segs = [Segment(q_start, min(prefill_len, tk))] if q_start < prefill_len else []
    states = [st for st in hf_flushes(prefill_len, tk, method.residual) if st[1] <= ks.shape[1]]
    dq_k = dq_v = None
    for i, (start, count) in enumerate(states):
        end = states[i + 1][0] if i + 1 < len(states) else tk
        src_k = x_k[:, :, :count] if dq_k is None else torch.cat([dq_k, x_k[:, :, dq_k.shape[2]:count]], 2)
        src_v = x_v[:, :, :count] if dq_v is None else torch.cat([dq_v, x_v[:, :, dq_v.shape[2]:count]], 2)
        dq_k = hl._dequantize(hl._quantize(src_k.contiguous(), axis=hl.axis_key)).float()
        dq_v = hl._dequantize(hl._quantize(src_v.contiguous(), axis=hl.axis_value)).float()
        if end <= max(start, q_start):
            continue

        def ranges(pos, c=count):
            z = torch.zeros_like(pos)
            return z, z + c, z + c

        segs.append(_noisy(Segment(max(start, q_start), end, 0, dq_k[0], dq_v[0], ranges), method, layer))
    return segs


__all__ = [
    "HF_BACKENDS", "KINDS", "Method", "Prepared", "Segment", "hf_backend_layer", "hf_flushes",
    "covers", "hf_quantized_count", "kivi_keys", "kivi_values", "prepare", "quant_dequant_pages", "stored_rows",
]
