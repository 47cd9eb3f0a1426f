"""Which layers store 4-bit keys: attention error of stored keys per layer on held-out calibration text, and a
greedy allocation of wider key pages within a page-bit budget (issue 17).

Issue 17 found that the keys, not the values, break needle retrieval, spread over many layers. This module
chooses the layers from calibration text alone. For one layer's held-out sequences (``capture.HeldOut``, the
collector's ``"heldout"`` mode), the last ``queries`` positions of each sequence attend over the keys as the
cache stores them: sink and recent rows BF16, the rows of whole pages through a page quantizer (by default
``kernels.reference.quantize_pages`` / ``dequantize_pages`` on the layer's layout). The error is the mean over
those queries and every query head of

* ``kl``: ``KL(p_bf16 || p_stored)`` of the attention probabilities over every key the query reads, or
* ``top``: ``sum |p_bf16 - p_stored|`` over the ``top`` page rows with the largest ``p_bf16`` (the few tokens a
  retrieving head attends to: a needle's digits are such rows).

Values play no part. :func:`layer_key_errors` measures a layer's keys at 2 bits (its fitted clips and levels)
and at 4 bits (``layout.with_key_bits(4)``, plain min-max: clip 1, which is what a 4-bit layer of the artifact
then stores); :func:`allocate_key_bits` gives 4-bit keys to the layers where 4 bits remove the most of the
metric, best first, while the average page bits per element (``KVCacheLayout.int2_bits_per_element`` of each
paged layer's layout, averaged over those layers) stay within the budget.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Sequence

import torch

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.reference import dequantize_pages, quantize_pages
from oscar_export.kernels.transform import LayerTransform

from .capture import HeldOut

#: metrics :func:`key_attention_error` reports (``CalibrationConfig.key_bits_metric`` picks one).
METRICS = ("kl", "top")
#: query positions per held-out sequence (its last ones) and most-attended page rows of the ``top`` metric.
QUERIES = 64
TOP = 8
#: the wider key width calibration allocates.
WIDE_BITS = 4
#: the page-bit budget of the default calibration: on SmolLM2 (EVALUATION.md, "Needles as deployed with 4-bit keys")
#: 4-bit keys in the 15 of 30 layers it chose kept NIAH within one needle of BF16 and cut the 8K text KL 7.6x.
DEFAULT_BUDGET = 3.0
#: held-out sequence length below which ``calibrate`` warns that the choice is made on too few page rows (and
#: its ``--seq-len`` default with ``--key-bits-budget``):
#: on SmolLM2 (EVALUATION.md, "Needles as deployed with 4-bit keys") sequences of 512 tokens (192 page rows each)
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


@torch.no_grad()
def key_attention_error(held: HeldOut, transform: LayerTransform, layout: KVCacheLayout,
                        stored: PageKeys | None = None, queries: int = QUERIES, top: int = TOP) -> dict[str, float]:
    """The attention error of one layer's stored keys (module doc): ``{"kl": ..., "top": ...}``.

    Args:
        held: the layer's held-out q ``[N, H, T, D]`` and k ``[N, H_kv, T, D]`` (post-RoPE, model basis).
        transform: the layer's transform (gives the stored basis; default quantizer's clips and levels).
        layout: windows and page size (and the default quantizer's key format).
        stored: what the pages read back (:data:`PageKeys`); default :func:`page_keys` of ``layout`` with the
            transform's key clips and levels.
        queries: the last ``queries`` positions of each sequence are the queries; top: rows of ``top``.
    """
    q, k, scale = held.q, held.k, held.scaling
    n, hq, t, _ = q.shape
    hkv = k.shape[1]
    if not 0 < queries <= t:
        raise ValueError(f"key_attention_error: queries must be in [1, {t}] (the sequence length), got {queries}")
    stored = stored or page_keys(layout, transform.k_clip, transform.k_levels)
    dev = transform.k_clip.device
    pos = torch.arange(t - queries, t, device=dev)
    lo, hi = paged_rows(layout, pos)  # rows [lo, hi) read from pages for the query at pos
    c0, c1 = layout.sink, int(hi.max())
    if c1 <= c0:
        raise ValueError(f"key_attention_error: {t} tokens leave no page before the last {queries} queries "
                         f"(sink {layout.sink}, window {layout.window}, page {layout.page_size})")
    grp = hq // hkv
    col = torch.arange(t, device=dev)
    in_pages = (col[None] >= lo[:, None]) & (col[None] < hi[:, None])  # [Q, T]
    causal = col[None] <= pos[:, None]
    total = {"kl": 0.0, "top": 0.0}
    for i in range(n):
        ks = transform.transform_keys(k[i : i + 1].to(dev))[0].to(torch.bfloat16).float()  # [H_kv, T, D]
        qs = transform.transform_queries(q[i : i + 1].to(dev))[0][:, -queries:].float()  # [H, Q, D]
        rows = stored(ks[:, c0:c1])
        k_hat = ks.clone()
        if rows is not None:
            k_hat[:, c0:c1] = rows
        s_ref = scale * qs @ ks.repeat_interleave(grp, 0).transpose(1, 2)  # [H, Q, T]
        s_got = torch.where(in_pages[None], scale * qs @ k_hat.repeat_interleave(grp, 0).transpose(1, 2), s_ref)
        lp = torch.log_softmax(s_ref.masked_fill(~causal[None], float("-inf")), -1)
        lg = torch.log_softmax(s_got.masked_fill(~causal[None], float("-inf")), -1)
        p_ref, p_got = lp.exp(), lg.exp()
        kl = (p_ref * (lp - lg)).masked_fill(~causal[None], 0.0).sum(-1)  # [H, Q]
        idx = p_ref.masked_fill(~in_pages[None], -1.0).topk(min(top, c1 - c0), -1).indices  # [H, Q, top]
        shift = (p_ref.gather(-1, idx) - p_got.gather(-1, idx)).abs().sum(-1)  # [H, Q]
        total["kl"] += float(kl.mean())
        total["top"] += float(shift.mean())
    return {m: v / n for m, v in total.items()}


def layer_key_errors(held: HeldOut, transform: LayerTransform, layout: KVCacheLayout, queries: int = QUERIES,
                     wide: int = WIDE_BITS) -> dict[int, dict[str, float]]:
    """``{2: error, wide: error}`` of one layer: its keys at 2 bits (the transform's clips and levels) and at
    ``wide`` bits (``layout.with_key_bits(wide)``, clip 1: min-max)."""
    wide_layout = layout.with_key_bits(wide)
    ones = torch.ones_like(transform.k_clip)
    return {
        layout.key.bits: key_attention_error(held, transform, layout, queries=queries),
        wide: key_attention_error(held, transform, layout,
                                  page_keys(wide_layout, ones, transform.k_levels), queries=queries),
    }


def check_budget(budget: float, layout: KVCacheLayout) -> None:
    """``ValueError`` unless ``budget`` (page bits per element) reaches ``layout``'s 2-bit pages: the check
    ``calibrate`` makes before capture, and the command line before the model loads where it can."""
    base = layout.int2_bits_per_element()
    if not budget >= base - 1e-9:
        raise ValueError(f"key_bits_budget: {budget:g} bits per element is below the {base:g} of this model's 2-bit "
                         f"pages (head_dim {layout.head_dim}, page {layout.page_size}); {base:g} or more, or none for "
                         f"2-bit keys in every layer")


def check_budget_any_model(budget: float, layout_for_head_dim) -> None:
    """``ValueError`` when ``budget`` is below the 2-bit pages of every model: what the command line refuses before
    it knows the model (``layout_for_head_dim(d)``: the layout of the run's options at head_dim ``d``). Groups are
    capped at 128 elements (``layout.default_group_size``), so head_dim 128 and 256 hold the least page bits."""
    least = min((layout_for_head_dim(d) for d in (128, 256)), key=lambda lay: lay.int2_bits_per_element())
    base = least.int2_bits_per_element()
    if not budget >= base - 1e-9:
        raise ValueError(f"key_bits_budget: {budget:g} bits per element is below the {base:g} that 2-bit pages take "
                         f"at least (any head_dim, page {least.page_size}); {base:g} or more, or none for 2-bit keys "
                         f"in every layer")


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
                    workers: int = 1) -> tuple[tuple[int, ...], dict]:
    """Per-layer key widths for an artifact: ``(key_bits, stats)``.

    Args:
        heldout: layer -> its held-out q/k (``Collector.heldout_layer``).
        transforms: the fitted transforms (one per layer); layout: the artifact's (2-bit) layout.
        budget: average page bits per element (module doc); metric: one of :data:`METRICS`.
        skip: layers without pages (the family table's sliding layers): 2 bits, not measured.
        progress: called with 1 after each layer (in layer order).
        workers: layers measured at once, each in its own thread (independent: the result does not depend on it).
    Returns:
        ``key_bits`` (one per layer) and JSON stats (budget, metric, chosen layers, per-layer errors; None for
        skipped layers).
    """
    if metric not in METRICS:
        raise ValueError(f"key_bits_metric: expected one of {METRICS}, got {metric!r}")
    check_budget(budget, layout)
    def one(i: int) -> dict | None:
        return None if i in skip else layer_key_errors(heldout(i), transforms[i], layout, queries, wide)

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


def widen_keys(transforms: Sequence[LayerTransform], key_bits: Sequence[int],
               layout: KVCacheLayout) -> list[LayerTransform]:
    """``transforms`` with key clip 1 (plain min-max, what :func:`layer_key_errors` measured) in the layers whose
    ``key_bits`` differ from ``layout``'s: the transforms an artifact with those ``key_bits`` stores."""
    return [replace(t, k_clip=torch.ones_like(t.k_clip)) if b != layout.key.bits else t
            for t, b in zip(transforms, key_bits, strict=True)]


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
           "check_budget", "check_budget_any_model", "choose_key_bits", "key_attention_error", "layer_key_errors", "page_keys", "paged_rows",
           "parse_layers", "widen_keys"]
