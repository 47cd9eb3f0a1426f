"""Variants of our page format for the retrieval diagnosis and its candidate fixes (issue 17), fake-quantized.

:class:`PageVariant` is :class:`PagedInt2` (same layout, transforms, windows and decode-as-deployed rule) with
three options, alone or combined:

* ``units``: per (layer, KV head, K or V) a different code width for the pages: 16 (kept at full precision,
  the BF16 swap of the diagnosis) or 4 (the row format's 4-bit codes, ``quantizers.with_side_bits``: uniform
  levels, the reference rule with 16 levels, the same fp16 params). Everything else: our pages (2-bit, or the
  base model's ``key_bits``).
* ``anchors``: per page, KV head and side, the ``anchors`` rows chosen at demotion are also kept in BF16
  (stored beside the page with a one-byte row index); chosen by ``anchor_score`` = ``"error"`` (largest
  ``|x - x_hat|^2`` of that side's row, the quantizer's own output) or ``"keynorm"`` (largest stored key norm,
  an attention-mass proxy, the same tokens for K and V). ``anchor_exclude``: anchors do not take part in the
  page's quantization statistics (for channel-granular keys their rows are replaced by the page's per-channel
  mean of the other rows before quantizing; token-granular rows are independent, nothing changes).
* value groups: pass a layout whose ``value`` row format has a smaller ``group_size`` (:func:`with_value_group`);
  the byte count follows from the layout.

Bits per element count every stored byte: sink and recent BF16, per-unit codes and fp16 params, anchors at
``16 * D + 8`` bits per row. :meth:`PageVariant.page_bits` is the average over the pages alone (the "INT2
part" of issue 17's budget: 2.5 for our artifact).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from oscar_export.kernels.layout import KVCacheLayout, RowFormat

from .cache_models import PagedInt2
from .quantizers import page_roundtrip, with_side_bits

SIDES = ("k", "v")
UNIT_BITS = (4, 16)
ANCHOR_SCORES = ("error", "keynorm")
#: bits of one anchor row's index within its page (one byte: P <= 256).
ANCHOR_INDEX_BITS = 8


@dataclass(frozen=True, eq=False)
class PageVariant(PagedInt2):
    """Our pages with per-unit code widths, BF16 anchors and/or other value groups (module doc).

    Args:
        units: ``((layer, kv_head, side, bits), ...)``; ``kv_head`` -1 = every head of the layer; ``bits``
            in ``UNIT_BITS``. A unit named twice is an error.
        anchors: BF16 rows per page, KV head and anchored side (0: none; ``page_size``: every row).
        anchor_score: one of ``ANCHOR_SCORES``.
        anchor_sides: ``"kv"``, ``"k"`` or ``"v"``.
        anchor_exclude: keep anchors out of the page's quantization statistics.
        wide_clip: 4-bit units use the transform's (2-bit) clip ratios; False: plain min-max (except the keys of
            a layer the base model already stores at 4 bits: its own clips).
        base_kv_heads: KV heads of one prompt (set from the layout; ``fold`` keeps it).
    """

    units: tuple[tuple[int, int, str, int], ...] = ()
    anchors: int = 0
    anchor_score: str = "error"
    anchor_sides: str = "kv"
    anchor_exclude: bool = False
    wide_clip: bool = False
    base_kv_heads: int = 0

    kind: ClassVar[str] = "pages-variant"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.param_dtype != "float16":
            raise NotImplementedError("PageVariant: only the cache's own float16 params are implemented")
        if not self.base_kv_heads:
            object.__setattr__(self, "base_kv_heads", self.layout.num_kv_heads)
        n_layers, hkv = len(self.transforms), self.base_kv_heads
        seen = set()
        units = tuple((int(a), int(b), str(c), int(d)) for a, b, c, d in self.units)
        for layer, head, side, bits in units:
            if not (0 <= layer < n_layers and -1 <= head < hkv and side in SIDES and bits in UNIT_BITS):
                raise ValueError(f"PageVariant {self.name!r}: unit {(layer, head, side, bits)} is not "
                                 f"(layer < {n_layers}, -1 <= head < {hkv}, side in {SIDES}, bits in {UNIT_BITS})")
            for h in range(hkv) if head < 0 else (head,):
                if (layer, h, side) in seen:
                    raise ValueError(f"PageVariant {self.name!r}: unit (layer {layer}, head {h}, {side}) named twice")
                seen.add((layer, h, side))
        object.__setattr__(self, "units", units)
        if not 0 <= self.anchors <= self.layout.page_size:
            raise ValueError(f"PageVariant.anchors: expected 0..{self.layout.page_size}, got {self.anchors}")
        if self.anchor_score not in ANCHOR_SCORES:
            raise ValueError(f"PageVariant.anchor_score: expected one of {ANCHOR_SCORES}, got {self.anchor_score!r}")
        if self.anchor_sides not in ("kv", "k", "v"):
            raise ValueError(f"PageVariant.anchor_sides: expected 'kv', 'k' or 'v', got {self.anchor_sides!r}")

    # ---- what each (layer, head, side) holds -------------------------------------------------------------
    def unit_bits(self) -> torch.Tensor:
        """``[L, H_kv, 2]`` long: code bits per (layer, KV head of one prompt, side K=0 / V=1); by default our
        pages' (2, or the layer's ``key_bits`` for K)."""
        out = torch.full((len(self.transforms), self.base_kv_heads, 2), 2, dtype=torch.long)
        for layer in range(len(self.transforms)):
            out[layer, :, 0] = self.layer_layout(layer).key.bits
        for layer, head, side, bits in self.units:
            out[layer, slice(None) if head < 0 else head, SIDES.index(side)] = bits
        return out

    def page_bits(self) -> float:
        """Average stored bits per element of the pages alone (codes, params, anchors; K and V, every layer)."""
        lay, d, p = self.layout, self.layout.head_dim, self.layout.page_size
        params = torch.tensor([lay.key.bits_per_element(p) - 2, lay.value.bits_per_element(p) - 2])  # [2]
        ub = self.unit_bits().double()
        per = torch.where(ub >= 16, torch.full_like(ub, 16.0), ub + params.double())
        anchored = torch.tensor([s in self.anchor_sides for s in SIDES], dtype=torch.float64)
        per = per + (ub < 16) * anchored * self.anchors * (16.0 * d + ANCHOR_INDEX_BITS) / (p * d)
        return float(per.mean())

    def bits_per_element(self, length: int) -> float:
        if length <= 0:
            raise ValueError(f"length: expected > 0, got {length}")
        sink, pages, recent = self.layout.split(length)
        return ((sink + recent) * 16.0 + pages * self.layout.page_size * self.page_bits()) / length

    def fold(self, prompts: int) -> "PageVariant":
        return replace(super().fold(prompts), base_kv_heads=self.base_kv_heads)

    # ---- the page contents ------------------------------------------------------------------------------------
    def page_rows(self, layer: int, x: torch.Tensor, side: str, keys: torch.Tensor) -> torch.Tensor | None:
        hf = x.shape[0]
        bits = self.unit_bits()[layer, :, SIDES.index(side)].repeat(hf // self.base_kv_heads).to(x.device)  # [H_f]
        if bool((bits >= 16).all()):
            return None
        out = self._quantized(layer, x, side, bits)
        if self.anchors > 0 and side in self.anchor_sides:
            keep = self._anchor_mask(x, out, keys)  # [H_f, N*P]
            fmt = self.layout.key if side == "k" else self.layout.value
            if self.anchor_exclude and fmt.granularity == "channel":
                out = self._quantized(layer, _without_anchors(x, keep, self.layout.page_size), side, bits)
            out = torch.where(keep[..., None], x, out)
        return torch.where((bits >= 16)[:, None, None], x, out)

    def _quantized(self, layer: int, x: torch.Tensor, side: str, bits: torch.Tensor) -> torch.Tensor:
        """Every head's pages at its own width (16-bit heads: anything, replaced by the caller)."""
        t = self.transforms[layer]
        out = page_roundtrip(x, self.layout, t, side, self.param_dtype)
        if bool((bits == 4).any()):
            own = side == "k" and self.layer_layout(layer).key.bits == 4  # the base model's 4-bit keys
            if not (self.wide_clip or own):
                t = replace(t, k_clip=torch.ones_like(t.k_clip), v_clip=torch.ones_like(t.v_clip))
            wide = page_roundtrip(x, with_side_bits(self.layout, side, 4), t, side, self.param_dtype)
            out = torch.where((bits == 4)[:, None, None], wide, out)
        return out

    def _anchor_mask(self, x: torch.Tensor, x_hat: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[H_f, N*P]`` bool: the ``anchors`` rows of each page and head with the largest score (``x, x_hat,
        keys [H_f, N*P, D]``: the rows, their quantized read-back, the same tokens' stored keys)."""
        h, t, _ = x.shape
        p = self.layout.page_size
        score = (x_hat - x).square().sum(-1) if self.anchor_score == "error" else keys.square().sum(-1)
        top = score.view(h, t // p, p).topk(self.anchors, dim=-1).indices  # [H_f, N, a]
        mask = torch.zeros(h, t // p, p, dtype=torch.bool, device=x.device)
        mask.scatter_(-1, top, True)
        return mask.view(h, t)

    def summary(self) -> dict:
        d = super().summary()
        d.update(units=[list(u) for u in self.units], anchors=self.anchors, anchor_score=self.anchor_score,
                 anchor_sides=self.anchor_sides, anchor_exclude=self.anchor_exclude,
                 value_group=self.layout.value.group_size, page_bits=round(self.page_bits(), 4))
        return d


def _without_anchors(x: torch.Tensor, keep: torch.Tensor, page_size: int) -> torch.Tensor:
    """``x [H, N*P, D]`` with the anchored rows (``keep [H, N*P]``) of each page replaced by the per-channel mean
    of the page's other rows, so that the anchors no longer set a channel-granular page's ranges."""
    h, t, d = x.shape
    p = page_size
    xp = x.view(h, t // p, p, d)
    kp = keep.view(h, t // p, p, 1)
    rest = (~kp).float()
    mean = (xp * rest).sum(2, keepdim=True) / rest.sum(2, keepdim=True).clamp(min=1)
    return torch.where(kp, mean.expand_as(xp), xp).reshape(h, t, d)


def with_value_group(layout: KVCacheLayout, group: int) -> KVCacheLayout:
    """``layout`` with values quantized in groups of ``group`` elements (more fp16 params per row)."""
    return replace(layout, value=RowFormat(layout.head_dim, group, "token", layout.value.bits, layout.value.codebook))


def variant(base: PagedInt2, name: str, description: str = "", value_group: int | None = None,
            **options) -> PageVariant:
    """A :class:`PageVariant` of ``base`` (our method: its layout and transforms) with ``options``."""
    lay = base.layout if value_group is None else with_value_group(base.layout, value_group)
    return PageVariant(name, description, layout=lay, transforms=base.transforms, key_bits=base.key_bits, **options)


__all__ = ["ANCHOR_INDEX_BITS", "ANCHOR_SCORES", "SIDES", "UNIT_BITS", "PageVariant", "variant", "with_value_group"]
