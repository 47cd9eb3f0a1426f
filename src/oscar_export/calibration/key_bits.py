"""Which layers store 4-bit keys: attention error of stored keys per layer on held-out calibration text, and a
greedy allocation of wider key pages within a page-bit budget.

The keys, not the values, break needle retrieval, spread over many layers. This module chooses the layers
from calibration text alone. For one layer's held-out sequences (``capture.HeldOut``, the
collector's ``"heldout"`` mode), the last ``queries`` positions of each sequence attend over the keys as the
cache stores them: sink and recent rows BF16, the rows of whole pages through a page quantizer (by default
``kernels.reference.quantize_pages`` / ``dequantize_pages`` on the layer's layout). The error is the mean over
those queries and every query head of

* ``kl``: ``KL(p_bf16 || p_stored)`` of the attention probabilities over every key the query reads, or
* ``top``: ``sum |p_bf16 - p_stored|`` over the ``top`` page rows with the largest ``p_bf16`` (the few tokens a
  retrieving head attends to: a needle's digits are such rows).

Values play no part. :func:`layer_key_errors` measures a layer's keys at 2 bits and at 4 bits
(``layout.with_key_bits(4)``), each width with its key clips chosen per head against the same metric
(:func:`fit_key_clip`: a descent along a clip grid, at 2 bits from the clips fitted on the mean squared score
error, at 4 bits from min-max), and the artifact stores the clips of the width it gets (:func:`set_key_clips`);
:func:`allocate_key_bits` gives 4-bit keys to the layers where 4 bits remove the most of the metric, best first,
while the average page bits per element (``KVCacheLayout.int2_bits_per_element`` of each paged layer's layout,
averaged over those layers) stay within the budget.

Why the clips are chosen again: the fit minimises the mean squared score error ``E (q·(k - k_hat))^2`` over every
query and key (``objective.py``), which clips hard (ratios 0.80-0.92 on SmolLM2) and weighs the few keys a query
attends to like any other; the attention KL weighs each score error by the probability it moves. On SmolLM2's
dev text (``eval --split dev``, 4 windows) KL-chosen clips lowered the text KL at 2K/4K tokens by 11 % / 9 %
(docs/evaluation.md, "Calibration").
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.reference import (
    dequantize_groups,
    dequantize_pages,
    format_levels,
    quantize_groups,
    quantize_pages,
)
from oscar_export.kernels.transform import LayerTransform, clip_rank

from .capture import HeldOut
from .clipping import DEFAULT_GRID, clip_grid, fit_clip

#: metrics :func:`key_attention_error` reports (``CalibrationConfig.key_bits_metric`` picks one).
METRICS = ("kl", "top")
#: query positions per held-out sequence (its last ones) and most-attended page rows of the ``top`` metric.
QUERIES = 64
TOP = 8
#: the wider key width calibration allocates.
WIDE_BITS = 4
#: the page-bit budget of the default calibration: on SmolLM2 (benchmarks/results/deployed-k4-h200-2026-12-01.json)
#: 4-bit keys in the 15 of 30 layers it chose kept NIAH within one needle of BF16 and cut the 8K text KL 7.6x.
DEFAULT_BUDGET = 3.0
#: held-out sequence length below which ``calibrate`` warns that the choice is made on too few page rows (and
#: its ``--seq-len`` default with ``--key-bits-budget``):
#: on SmolLM2 (benchmarks/results/deployed-k4-h200-2026-12-01.json) sequences of 512 tokens (192 page rows each)
#: chose layers that answered 51 of 160 needles as deployed, sequences of 2,048 chose ones that answered 57 (BF16 60).
MIN_SEQ_LEN = 2048

#: ``x [H_kv, N*P, D]`` stored-basis key rows of whole pages -> what the pages read back (same shape), or None
#: where the pages keep them at full precision.
PageKeys = Callable[[torch.Tensor], "torch.Tensor | None"]


def page_keys(layout: KVCacheLayout, clip: torch.Tensor, levels: torch.Tensor) -> PageKeys:
    """The reference quantizer of ``layout``'s key pages (``clip [H_kv]``, ``levels [H_kv, 4]``) as a
    :data:`PageKeys`."""
    p = layout.page_size

    def read_back(x: torch.Tensor) -> torch.Tensor:
        h, t, d = x.shape
        pages = x.reshape(h, t // p, p, d).transpose(0, 1)  # [N, H_kv, P, D]
        codes, params = quantize_pages(pages, layout.key, clip.to(x.device), levels.to(x.device))
        return dequantize_pages(codes, params, layout.key, levels.to(x.device)).transpose(0, 1).reshape(h, t, d)

    return read_back


def paged_rows(layout: KVCacheLayout, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` long ``[Q]``: the query at position ``pos`` reads rows ``[lo, hi)`` from pages (``layout.split``
    of ``pos + 1`` tokens)."""
    _, pages, _ = layout.split(pos + 1)
    lo = torch.full_like(pos, layout.sink)
    return lo, lo + pages * layout.page_size


class KeyAttention:
    """One layer's held-out queries over its keys as the cache stores them (module doc), the parts that do not
    depend on the page quantizer computed once: :meth:`errors` measures one quantizer.

    Only the page rows change, so a query's KL is ``sum_pages p (s - s_hat) + log(Z_hat / Z)`` with ``s`` its
    scores, ``p`` its probabilities and ``Z`` the softmax normaliser (``Z_hat``: the same with the pages read
    back): one product over the page rows a measurement.

    Args:
        held: the layer's held-out q ``[N, H, T, D]`` and k ``[N, H_kv, T, D]`` (post-RoPE, model basis).
        transform: the layer's transform (gives the stored basis).
        layout: windows and page size.
        queries: the last ``queries`` positions of each sequence are the queries; top: rows of ``top``.
    """

    @torch.no_grad()
    def __init__(self, held: HeldOut, transform: LayerTransform, layout: KVCacheLayout, queries: int = QUERIES,
                 top: int = TOP) -> None:
        q, k, scale = held.q, held.k, held.scaling
        n, hq, t, _ = q.shape
        hkv = k.shape[1]
        if not 0 < queries <= t:
            raise ValueError(f"key_attention_error: queries must be in [1, {t}] (the sequence length), got {queries}")
        dev = transform.k_clip.device
        pos = torch.arange(t - queries, t, device=dev)
        lo, hi = paged_rows(layout, pos)  # rows [lo, hi) read from pages for the query at pos
        c0, c1 = self.c0, self.c1 = layout.sink, int(hi.max())
        if c1 <= c0:
            raise ValueError(f"key_attention_error: {t} tokens leave no page before the last {queries} queries "
                             f"(sink {layout.sink}, window {layout.window}, page {layout.page_size})")
        g = hq // hkv
        col = torch.arange(t, device=dev)
        in_pages = ((col[None] >= lo[:, None]) & (col[None] < hi[:, None])).repeat(g, 1)  # [g*Q, T], rows (head, q)
        causal = (col[None] <= pos[:, None]).repeat(g, 1)
        self.scale, self.in_pages = scale, in_pages[:, c0:c1]  # [g*Q, c]
        self.ks = transform.transform_keys(k.to(dev)).to(torch.bfloat16).float()  # [N, H_kv, T, D]
        qs = transform.transform_queries(q.to(dev))[:, :, -queries:].float()  # [N, H, Q, D]
        self.qs = qs.reshape(n, hkv, g * queries, -1)  # [N, H_kv, g*Q, D]: the query heads of each KV head
        s = (scale * self.qs @ self.ks.transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # [N, H_kv, g*Q, T]
        self.m = s.amax(-1, keepdim=True)
        e = torch.exp(s - self.m)
        self.s_pages = self._scores(self.ks[:, :, c0:c1])  # [N, H_kv, g*Q, c]: as :meth:`errors` computes them
        self.z_out = (e * ~in_pages).sum(-1)  # [N, H_kv, g*Q]
        e_pages = torch.exp(self.s_pages - self.m)
        self.z = self.z_out + (e_pages * self.in_pages).sum(-1)
        self.p_rows = e_pages / self.z[..., None]  # [N, H_kv, g*Q, c] probabilities of the rows c0 .. c1
        self.p_pages = self.p_rows * self.in_pages
        # the ``top`` page rows of each query (largest p_bf16), whatever the quantizer
        self.top_idx = self.p_rows.masked_fill(~self.in_pages, -1.0).topk(min(top, c1 - c0), -1).indices
        self._sorted: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # row format -> groups, their sorted |x|

    @torch.no_grad()
    def read_back(self, layout: KVCacheLayout, clip: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """``[N, H_kv, c, D]``: the page rows as :func:`page_keys` of ``layout`` reads them back (the same numbers),
        each group's sorted ``|x|`` computed once per row format for every clip (``quantize_groups(sorted_abs=)``)."""
        fmt, p = layout.key, layout.page_size
        n, h, t, d = self.ks.shape
        c = self.c1 - self.c0
        key = (fmt.granularity, fmt.group_size, p)
        if key not in self._sorted:
            x = self.ks[:, :, self.c0 : self.c1].reshape(n, h, c // p, p, d).transpose(1, 2)  # [N, pages, H, P, D]
            x = x.transpose(-1, -2) if fmt.granularity == "channel" else x.reshape(*x.shape[:-1], d // fmt.group_size,
                                                                                    fmt.group_size)
            self._sorted[key] = (x, x.abs().sort(dim=-1).values)
        x, sorted_abs = self._sorted[key]
        lv = format_levels(fmt, levels.to(x.device))
        view = (1, 1, h, 1) if fmt.granularity == "channel" else (1, 1, h, 1, 1)
        rank = clip_rank(clip.to(x.device), x.shape[-1]).view(*view, 1)
        codes, scale, lo = quantize_groups(x, rank, lv.view(*view, -1), sorted_abs=sorted_abs)
        y = dequantize_groups(codes, scale, lo, lv.view(*view, -1))
        y = y.transpose(-1, -2) if fmt.granularity == "channel" else y.reshape(*y.shape[:-2], d)  # [N, pages, H, P, D]
        return y.transpose(1, 2).reshape(n, h, c, d)

    def _scores(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N, H_kv, g*Q, c]`` scores of the queries over page rows ``[N, H_kv, c, D]``."""
        return self.scale * self.qs @ rows.transpose(-1, -2)

    @torch.no_grad()
    def errors(self, stored: PageKeys | torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"kl": [H_kv], "top": [H_kv]}`` fp64: each KV head's mean over sequences, its query heads and queries
        of the metrics (module doc) with the pages read back by ``stored`` (or those rows, ``[N, H_kv, c, D]``:
        :meth:`read_back`)."""
        if isinstance(stored, torch.Tensor):
            rows = stored
        else:
            got = [stored(x[:, self.c0 : self.c1]) for x in self.ks]
            rows = torch.stack([x[:, self.c0 : self.c1] if r is None else r for x, r in zip(self.ks, got)])
        s_hat = torch.where(self.in_pages, self._scores(rows), self.s_pages)  # [N, H_kv, g*Q, c]
        e_hat = torch.exp(s_hat - self.m)
        z_hat = self.z_out + (e_hat * self.in_pages).sum(-1)
        kl = (self.p_pages * (self.s_pages - s_hat)).sum(-1) + torch.log(z_hat / self.z)  # [N, H_kv, g*Q]
        p_hat = e_hat.gather(-1, self.top_idx) / z_hat[..., None]
        shift = (self.p_rows.gather(-1, self.top_idx) - p_hat).abs().sum(-1)
        return {"kl": kl.double().mean(dim=(0, 2)), "top": shift.double().mean(dim=(0, 2))}


def key_attention_error(held: HeldOut, transform: LayerTransform, layout: KVCacheLayout,
                        stored: PageKeys | None = None, queries: int = QUERIES, top: int = TOP) -> dict[str, float]:
    """The attention error of one layer's stored keys (module doc): ``{"kl": ..., "top": ...}``, the mean over KV
    heads of :meth:`KeyAttention.errors`.

    ``stored``: what the pages read back (:data:`PageKeys`); default :func:`page_keys` of ``layout`` with the
    transform's key clips and levels.
    """
    stored = stored or page_keys(layout, transform.k_clip, transform.k_levels)
    return {m: float(v.mean()) for m, v in KeyAttention(held, transform, layout, queries, top).errors(stored).items()}


def clip_group(layout: KVCacheLayout) -> int:
    """Elements a key clip ratio ranks: the page's rows of a channel, or a token's group."""
    return layout.page_size if layout.key.granularity == "channel" else layout.key.group_size


def fit_key_clip(att: KeyAttention, layout: KVCacheLayout, levels: torch.Tensor, metric: str, grid: Sequence[float],
                 start: torch.Tensor, per_head: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The key clip ratios ``[H_kv]`` of ``grid`` that minimise ``metric`` of ``att`` with ``layout``'s key pages
    (``levels [H_kv, 4]``): ``clipping.fit_clip``'s descent along the grid from each head's ``start`` ``[H_kv]``
    (the grid ratio of its clip rank, or the nearest); returns the clips and both metrics ``{"kl": [H_kv],
    "top": [H_kv]}`` at them (``per_head`` False: one ratio for the layer)."""
    h, group = levels.shape[0], clip_group(layout)
    ranks = clip_rank(torch.tensor(list(grid), dtype=torch.float32), group)  # [R]
    first = (ranks[None, :] - clip_rank(start.float().cpu(), group)[:, None]).abs().argmin(1)  # [H]
    seen: dict[tuple[float, ...], dict[str, torch.Tensor]] = {}

    def errors(clips: list[torch.Tensor]) -> torch.Tensor:
        out = []
        for c in clips:
            key = tuple(c.tolist())
            if key not in seen:
                seen[key] = att.errors(att.read_back(layout, c, levels))
            e = seen[key]
            out.append(e[metric])
        return torch.stack(out)  # [R, H_kv]

    clip = fit_clip(errors, h, list(grid), per_head=per_head, local=True, start=first).clip
    # each head's errors depend on its own clip only: read them from a measurement where it had its chosen one
    both = {m: torch.empty(h, dtype=torch.float64) for m in METRICS}
    for key, e in seen.items():
        hit = torch.tensor(key, dtype=torch.float32) == clip
        for m in METRICS:
            both[m] = torch.where(hit, e[m], both[m])
    return clip, both


#: clip ratios the key-width search tries per head at 2 bits (from the fit's clip, chosen on the score error) and at
#: the wider width (from min-max; 16 levels clip less: on SmolLM2 no 4-bit head chose below 0.92 on the whole grid).
NARROW_CLIPS = DEFAULT_GRID
WIDE_CLIPS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9)


def layer_key_errors(held: HeldOut, transform: LayerTransform, layout: KVCacheLayout, metric: str = "kl",
                     queries: int = QUERIES, wide: int = WIDE_BITS,
                     per_head: bool = True) -> dict[int, dict[str, Any]]:
    """``{2: {"kl", "top", "clip", "heads"}, wide: {...}}`` of one layer: its keys at 2 bits and at ``wide`` bits
    (``layout.with_key_bits(wide)``), each with the key clips (``[H_kv]`` list) chosen against ``metric`` on these
    queries (:func:`fit_key_clip`, at 2 bits from the transform's clips, at ``wide`` from min-max), the metrics
    averaged over KV heads at those clips, and ``heads``: each metric per KV head (``[H_kv]`` lists)."""
    att = KeyAttention(held, transform, layout, queries)
    out: dict[int, dict[str, Any]] = {}
    widths = ((layout, NARROW_CLIPS, transform.k_clip),
              (layout.with_key_bits(wide), WIDE_CLIPS, torch.ones_like(transform.k_clip)))
    for lay, ratios, start in widths:
        grid = clip_grid(clip_group(lay), ratios)
        clip, err = fit_key_clip(att, lay, transform.k_levels, metric, grid, start, per_head)
        out[lay.key.bits] = {**{m: float(v.mean()) for m, v in err.items()}, "clip": clip.tolist(),
                             "heads": {m: v.tolist() for m, v in err.items()}}
    return out


def check_budget(budget: float, layout: KVCacheLayout) -> None:
    """``ValueError`` unless ``budget`` (page bits per element) reaches ``layout``'s 2-bit pages: the check
    ``calibrate`` makes before capture, and the command line before the model loads where it can."""
    base = layout.int2_bits_per_element()
    if not budget >= base - 1e-9:
        raise ValueError(f"key_bits_budget: {budget:g} bits per element is below the {base:g} of this model's 2-bit "
                         f"pages (head_dim {layout.head_dim}, page {layout.page_size}); {base:g} or more, or none for "
                         f"2-bit keys in every layer")


def allocate_key_bits(gains: Sequence[float | None], layout: KVCacheLayout, budget: float,
                      wide: int = WIDE_BITS) -> list[int]:
    """The layers to give ``wide``-bit keys, sorted: largest ``gains[i]`` first (the metric ``wide`` bits remove;
    None = a layer without pages, e.g. sliding, never chosen), while the page bits per element averaged over the
    paged layers stay within ``budget``; layers whose gain is not positive are never chosen (a budget below
    2-bit pages' bits chooses none)."""
    if not math.isfinite(budget):
        raise ValueError(f"key_bits_budget: expected a finite number of bits per element, got {budget}")
    paged = [i for i, g in enumerate(gains) if g is not None]
    if not paged:
        return []
    base, wider = layout.int2_bits_per_element(), layout.with_key_bits(wide).int2_bits_per_element()
    chosen: list[int] = []
    for i in sorted(paged, key=lambda j: (-gains[j], j)):
        wide_n = len(chosen) + 1
        if gains[i] <= 0 or ((len(paged) - wide_n) * base + wide_n * wider) / len(paged) > budget + 1e-9:
            break
        chosen.append(i)
    return sorted(chosen)


def choose_key_bits(heldout: Callable[[int], HeldOut], transforms: Sequence[LayerTransform], layout: KVCacheLayout,
                    budget: float, metric: str = "kl", skip: Sequence[int] = (), queries: int = QUERIES,
                    wide: int = WIDE_BITS, progress: Callable[[int], None] | None = None,
                    workers: int = 1, per_head: bool = True) -> tuple[tuple[int, ...], dict]:
    """Per-layer key widths and key clips for an artifact: ``(key_bits, stats)``.

    Args:
        heldout: layer -> its held-out q/k (``Collector.heldout_layer``).
        transforms: the fitted transforms (one per layer); layout: the artifact's (2-bit) layout.
        budget: average page bits per element (module doc); metric: one of :data:`METRICS`, what the 4-bit keys
            must reduce and what each width's key clips are chosen against (:func:`layer_key_errors`).
        skip: layers without pages (the family table's sliding layers): 2 bits, not measured.
        progress: called with 1 after each layer (in layer order).
        workers: layers measured at once, each in its own thread (independent: the result does not depend on it).
        per_head: a key clip per KV head (False: one per layer).
    Returns:
        ``key_bits`` (one per layer) and JSON stats (budget, metric, chosen layers, per-layer errors and clips of
        both widths, None for skipped layers; :func:`set_key_clips` reads the clips).
    """
    if metric not in METRICS:
        raise ValueError(f"key_bits_metric: expected one of {METRICS}, got {metric!r}")
    check_budget(budget, layout)
    def one(i: int) -> dict | None:
        return None if i in skip else layer_key_errors(heldout(i), transforms[i], layout, metric, queries, wide,
                                                       per_head)

    errors: list[dict | None] = []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for e in pool.map(one, range(len(transforms))):
            errors.append(e)
            if progress is not None:
                progress(1)
    gains = [None if e is None else e[layout.key.bits][metric] - e[wide][metric] for e in errors]
    chosen = allocate_key_bits(gains, layout, budget, wide)
    key_bits = tuple(wide if i in chosen else layout.key.bits for i in range(len(transforms)))
    stats = {
        "budget": budget, "metric": metric, "queries": queries, "wide_bits": wide, "layers": chosen,
        "errors": [None if e is None else {str(b): v for b, v in e.items()} for e in errors],
    }
    return key_bits, stats


def set_key_clips(transforms: Sequence[LayerTransform], key_bits: Sequence[int], stats: dict) -> list[LayerTransform]:
    """``transforms`` with each measured layer's key clips of its width from :func:`choose_key_bits`' ``stats``
    (the ones its error was measured with): the transforms an artifact with those ``key_bits`` stores."""
    errors = stats["errors"]
    if not len(transforms) == len(key_bits) == len(errors):
        raise ValueError(f"set_key_clips: expected one key width and one measurement per layer ({len(transforms)}), "
                         f"got {len(key_bits)} and {len(errors)}")
    return [t if e is None else replace(t, k_clip=torch.tensor(e[str(b)]["clip"], dtype=t.k_clip.dtype))
            for t, b, e in zip(transforms, key_bits, errors)]


def parse_layers(spec: str) -> list[int]:
    """``"6-8,14,28"`` -> ``[6, 7, 8, 14, 28]``: a layer set as the scripts and ``--k4`` options name it."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"layers: expected numbers and ranges like 6-8,14, got {spec!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"layers: expected ranges lo-hi with 0 <= lo <= hi, got {part!r} in {spec!r}")
        out.update(range(first, last + 1))
    return sorted(out)


__all__ = ["DEFAULT_BUDGET", "METRICS", "MIN_SEQ_LEN", "QUERIES", "TOP", "WIDE_BITS", "PageKeys", "allocate_key_bits",
           "KeyAttention", "NARROW_CLIPS", "WIDE_CLIPS", "check_budget", "choose_key_bits",
           "clip_group", "fit_key_clip", "key_attention_error", "layer_key_errors", "page_keys", "paged_rows",
           "parse_layers", "set_key_clips"]
