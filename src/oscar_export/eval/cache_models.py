"""The KV caches the evaluation compares, one small class each behind one protocol (:class:`CacheModel`).

Decode-as-deployed (docs/design.md §5): the query at absolute position ``a`` reads the cache as it stands after token
``a`` was appended. A cache model says, for a range of query positions over the stored rows of one layer,
which rows those queries read quantized (dequantized values) and which at full precision, as
:class:`Segment` s. Every stored row is first rounded to the store dtype (a BF16 cache).

* :class:`BF16Cache`    every token full precision.
* :class:`PagedInt2`    the OSCAR layout (naive INT2, QuaRot, the research recipe, ours): ``layout.split(a+1)``
  gives ``(sink, pages, recent)``; token ``j`` is INT2 iff ``S0 <= j < S0 + pages * P``. Pages are absolute,
  so every page is quantized once and each query picks quantized or full rows.
* :class:`Kivi2`        KIVI-2 (arXiv 2402.02750): keys per channel in groups of ``group`` tokens, flushed from
  a full-precision residual every ``residual`` tokens (key ``j`` INT2 iff ``j < floor((a+1)/R)*R``); values per
  token in groups of ``group`` channels, INT2 once older than the last ``R`` tokens.
* ``HFQuantized``  transformers' ``QuantizedCache`` (HQQ or quanto, any ``nbits``), its update rule replayed:
  ``hf_quantized.py``.

A new baseline is one new subclass: ``kind``, ``bits_per_element``, ``segments`` and ``reads_quantized``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Callable, ClassVar

import torch

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

from .quantizers import (
    PARAM_DTYPES,
    add_noise_like,
    kivi_keys,
    kivi_values,
    page_roundtrip,
)

NEVER = 1 << 62  # a segment valid for every later query position
Ranges = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class Segment:
    """Queries at positions ``[start, end)`` read ``k_alt``/``v_alt`` (dequantized rows ``[H_kv, n, D]``
    for token positions ``[c0, c0 + n)``) where ``ranges(pos) -> (lo, k_hi, v_hi)`` says so (keys
    ``[lo, k_hi)``, values ``[lo, v_hi)``), and the full-precision rows elsewhere. ``k_alt is None``: all full
    precision. ``valid_until``: the first query position this segment no longer describes, rows appended
    after it was built included (decode reuses a segment until then)."""

    start: int
    end: int
    c0: int = 0
    k_alt: torch.Tensor | None = None
    v_alt: torch.Tensor | None = None
    ranges: Ranges | None = None
    valid_until: int = NEVER


@dataclass(frozen=True, eq=False)
class CacheModel(ABC):
    """One cache method (see module doc).

    Args:
        name: short id used in tables and JSON.
        description: one line for the report.
        quantize: False reads every token at full precision (any transform still applies): the BF16 check.
        noise: replace every dequantized value by Gaussian noise of the same per-head mean and std (tests
            that the quantized path is what gets scored).
    """

    name: str
    description: str = ""
    quantize: bool = True
    noise: bool = False

    kind: ClassVar[str] = "?"

    # ---- what each subclass says ------------------------------------------------------------------------
    @abstractmethod
    def bits_per_element(self, length: int) -> float:
        """Stored bits per K/V element of a ``length``-token sequence fed token by token (windows included)."""

    @abstractmethod
    def _segments(self, layer: int, ks: torch.Tensor, vs: torch.Tensor, q_start: int, q_end: int,
                  prefill_len: int) -> list[Segment]:
        """Segments for queries ``[q_start, q_end)`` over stored rows ``ks, vs [H_kv, n, D]`` (quantize=True)."""

    @abstractmethod
    def _reads_quantized(self, pos: torch.Tensor, prefill_len: int) -> torch.Tensor:
        """``[T]`` bool: whether the query at ``pos`` reads any quantized row (quantize=True)."""

    def transform(self, layer: int) -> LayerTransform | None:
        """The stored-basis transform of ``layer`` (None: rows stored in the model basis)."""
        return None

    def to(self, device: torch.device | str) -> "CacheModel":
        """This method with its tensors on ``device``."""
        return self

    def fold(self, prompts: int) -> "CacheModel":
        """The same cache for ``prompts`` sequences of equal length folded into the KV-head axis (rows
        ``[prompts * H_kv, T, D]``, prompt-major): per-head parameters are tiled, and nothing is shared
        between prompts. A method without per-head parameters or cross-head quantization is its own fold."""
        return self

    # ---- shared behaviour --------------------------------------------------------------------------------
    def segments(self, layer: int, ks: torch.Tensor, vs: torch.Tensor, q_start: int, q_end: int,
                 prefill_len: int = 1) -> list[Segment]:
        """What queries ``[q_start, q_end)`` read over the stored rows ``ks, vs [H_kv, n, D]`` (float32)."""
        if not self.quantize:
            return [Segment(q_start, q_end)]
        segs = self._segments(layer, ks, vs, q_start, q_end, prefill_len)
        if self.noise:
            for s in segs:
                if s.k_alt is not None:
                    s.k_alt = add_noise_like(s.k_alt, 2 * layer)
                    s.v_alt = add_noise_like(s.v_alt, 2 * layer + 1)
        return segs

    def reads_quantized(self, pos: torch.Tensor, prefill_len: int = 1) -> torch.Tensor:
        """``[T]`` bool for query positions ``pos [T]``: True where the query reads quantized history."""
        if not self.quantize:
            return torch.zeros_like(pos, dtype=torch.bool)
        return self._reads_quantized(pos, prefill_len)

    def stored_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor, store_dtype: torch.dtype):
        """``k, v [H_kv, T, D]`` model basis -> ``(transform, ks, vs)``: stored basis, rounded to ``store_dtype``,
        returned as float32."""
        t = self.transform(layer)
        if t is not None:
            k = t.transform_keys(k.unsqueeze(0))[0]
            v = t.transform_values(v.unsqueeze(0))[0]
        return t, k.to(store_dtype).float(), v.to(store_dtype).float()

    def summary(self) -> dict:
        return {"name": self.name, "kind": self.kind, "description": self.description}


@dataclass(frozen=True, eq=False)
class BF16Cache(CacheModel):
    """Every token at full precision (stored in the store dtype)."""

    kind: ClassVar[str] = "full"

    def bits_per_element(self, length: int) -> float:
        check_length(length)
        return 16.0

    def _segments(self, layer, ks, vs, q_start, q_end, prefill_len):
        return [Segment(q_start, q_end)]

    def _reads_quantized(self, pos, prefill_len):
        return torch.zeros_like(pos, dtype=torch.bool)


@dataclass(frozen=True, eq=False)
class PagedInt2(CacheModel):
    """The OSCAR paged layout: sink and recent windows BF16, whole pages in between INT2.

    Args:
        layout: windows, page size, row formats.
        transforms: one ``LayerTransform`` per layer (rotation, scaling, mean, clips, levels).
        param_dtype: ``"float16"`` (our format, the reference quantizer bit-exactly) or ``"float32"`` (the
            research code's fp32 scale and minimum; token granularity only).
        key_bits: key code width per layer (an artifact's ``key_bits``); empty = the layout's in every layer.
    """

    layout: KVCacheLayout | None = None
    transforms: tuple[LayerTransform, ...] = ()
    param_dtype: str = "float16"
    key_bits: tuple[int, ...] = ()

    kind: ClassVar[str] = "pages"

    def __post_init__(self) -> None:
        if self.layout is None or not self.transforms:
            raise ValueError(f"PagedInt2 {self.name!r}: needs a layout and one transform per layer")
        object.__setattr__(self, "transforms", tuple(self.transforms))
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"PagedInt2.param_dtype: expected one of {PARAM_DTYPES}, got {self.param_dtype!r}")
        if self.param_dtype == "float32" and self.layout.key.granularity != "token":
            raise NotImplementedError("PagedInt2: float32 params are implemented for token-granular keys only")
        object.__setattr__(self, "key_bits", tuple(self.key_bits))
        if self.key_bits and len(self.key_bits) != len(self.transforms):
            raise ValueError(f"PagedInt2 {self.name!r}: key_bits: expected one per layer ({len(self.transforms)}), "
                             f"got {len(self.key_bits)}")
        if self.param_dtype == "float32" and any(b != self.layout.key.bits for b in self.key_bits):
            raise NotImplementedError("PagedInt2: float32 params are implemented for the layout's 2-bit keys only")
        for i, t in enumerate(self.transforms):
            if t.num_kv_heads != self.layout.num_kv_heads or t.head_dim != self.layout.head_dim:
                raise ValueError(
                    f"PagedInt2 {self.name!r}: transform {i} is [{t.num_kv_heads}, {t.head_dim}], "
                    f"layout is [{self.layout.num_kv_heads}, {self.layout.head_dim}]"
                )

    def transform(self, layer: int) -> LayerTransform:
        return self.transforms[layer]

    def layer_layout(self, layer: int) -> KVCacheLayout:
        """The layout of ``layer``'s pages: :attr:`layout` with that layer's ``key_bits``."""
        return self.layout.per_layer(self.key_bits)[layer] if self.key_bits else self.layout

    def to(self, device) -> "PagedInt2":
        return replace(self, transforms=tuple(t.to(device) for t in self.transforms))

    def fold(self, prompts: int) -> "PagedInt2":
        if prompts == 1:
            return self
        tile = lambda x: x.repeat(prompts, *([1] * (x.dim() - 1)))  # noqa: E731  [H_kv, ...] -> [P*H_kv, ...]
        ts = tuple(replace(t, **{f: tile(getattr(t, f)) for f in t.__dataclass_fields__ if f != "values_prerotated"})
                   for t in self.transforms)
        return replace(self, layout=replace(self.layout, num_kv_heads=prompts * self.layout.num_kv_heads),
                       transforms=ts)

    def int2_ranges(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lo, k_hi, v_hi)`` long ``[T]``: rows ``[lo, hi)`` are INT2 for the query at ``pos``."""
        lay = self.layout
        rest = (pos + 1 - lay.sink).clamp(min=0)
        pages = torch.div(rest - lay.recent_capacity + lay.page_size - 1, lay.page_size,
                          rounding_mode="floor").clamp(min=0)
        lo = torch.full_like(pos, lay.sink)
        hi = lo + pages * lay.page_size
        return lo, hi, hi

    def bits_per_element(self, length: int) -> float:
        check_length(length)
        lay = self.layout
        if self.param_dtype == "float16":
            n = len(self.transforms)
            return sum(self.layer_layout(i).effective_bits_per_element(length) for i in range(n)) / n
        sink, pages, recent = lay.split(length)
        int2 = 2.0 + 2 * 32.0 / lay.key.group_size  # fp32 (scale, lo) per G elements, K and V alike
        return ((sink + recent) * 16.0 + pages * lay.page_size * int2) / length

    def _segments(self, layer, ks, vs, q_start, q_end, prefill_len):
        lay = self.layout
        c0 = lay.sink
        c1 = c0 + max(0, ks.shape[1] - c0) // lay.page_size * lay.page_size
        valid = c1 + lay.recent_capacity  # query a reads pages up to S0 + pages(a+1) P <= c1 iff a < c1 + W + P
        if c1 <= c0:
            return [Segment(q_start, q_end, valid_until=valid)]
        k_alt = self.page_rows(layer, ks[:, c0:c1], "k")
        v_alt = self.page_rows(layer, vs[:, c0:c1], "v")
        return [Segment(q_start, q_end, c0, k_alt, v_alt, self.int2_ranges, valid)]

    def page_rows(self, layer: int, x: torch.Tensor, side: str) -> torch.Tensor:
        """What the pages hold: ``x [H_kv, N*P, D]`` stored-basis rows of whole pages (``side`` "k" or "v") ->
        dequantized rows ``[H_kv, N*P, D]`` float32."""
        return page_roundtrip(x, self.layer_layout(layer), self.transforms[layer], side, self.param_dtype)

    def _reads_quantized(self, pos, prefill_len):
        lo, k_hi, _ = self.int2_ranges(pos)
        return k_hi > lo


@dataclass(frozen=True, eq=False)
class Kivi2(CacheModel):
    """KIVI-2: per-channel keys / per-token values, ``group`` elements, full-precision residual ``residual``."""

    group: int = 32
    residual: int = 128

    kind: ClassVar[str] = "kivi"

    def __post_init__(self) -> None:
        if self.group <= 0 or self.residual <= 0 or self.residual % self.group:
            raise ValueError(f"Kivi2 {self.name!r}: residual must be a positive multiple of group, got "
                             f"group={self.group}, residual={self.residual}")

    def int2_ranges(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = pos + 1
        k_hi = torch.div(n, self.residual, rounding_mode="floor") * self.residual
        return torch.zeros_like(pos), k_hi, (n - self.residual).clamp(min=0)

    def bits_per_element(self, length: int) -> float:
        check_length(length)
        per = 2.0 + 2 * 16.0 / self.group  # 2-bit codes + fp16 scale and minimum per group
        kq = (length // self.residual) * self.residual
        vq = max(0, length - self.residual)
        return ((kq + vq) * per + (2 * length - kq - vq) * 16.0) / (2 * length)

    def _segments(self, layer, ks, vs, q_start, q_end, prefill_len):
        h, n, d = ks.shape
        r = self.residual
        if n == 0:
            return [Segment(q_start, q_end, valid_until=r - 1)]
        kq = n // self.group * self.group
        k_alt = torch.zeros_like(ks)
        k_alt[:, :kq] = kivi_keys(ks[:, :kq], self.group)
        v_alt = kivi_values(vs, self.group)
        # keys: k_hi(a) <= kq iff a < (kq // R + 1) R - 1; values: v_hi(a) <= n iff a < n + R
        valid = min((kq // r + 1) * r - 1, n + r)
        return [Segment(q_start, q_end, 0, k_alt, v_alt, self.int2_ranges, valid)]

    def _reads_quantized(self, pos, prefill_len):
        _, k_hi, v_hi = self.int2_ranges(pos)
        return (k_hi > 0) | (v_hi > 0)


def check_length(length: int) -> None:
    """A sequence length a cache model can answer ``bits_per_element`` for: a finite count above 0."""
    if length <= 0 or not math.isfinite(length):
        raise ValueError(f"length: expected > 0, got {length}")


__all__ = ["NEVER", "BF16Cache", "CacheModel", "Kivi2", "PagedInt2", "Segment", "check_length"]
