"""Which layers' keys need more than two bits: attention error of stored keys per layer, on calibration text.

Issue 17's diagnosis found the keys, not the values, break retrieval, spread over many layers (no single one
restores it). This module chooses the layers for wider key pages *without* looking at needles: on calibration
text, for every layer, the last ``queries`` positions of each sequence attend over the keys as a cache model
stores them (sink and recent rows BF16, the rows of whole pages through that model's ``page_rows``), and the
error is the mean over queries and query heads of ``KL(p_bf16 || p_stored)`` of the attention probabilities,
or the probability moved on the few page rows a query attends to most (values play no part). :func:`allocate` then gives 4-bit key pages to the layers where 4 bits remove the most
of that KL, greedily, while the page bits stay within a budget.

Both steps are measurement only (fake quantization through ``levers.PageVariant``); what they choose is
evaluated on the report split of the NIAH (``benchmarks/niah_diagnose.py --phases report``).
"""

from __future__ import annotations

import torch

from oscar_export.calibration import key_bits
from oscar_export.calibration.capture import Collector, run_batches
from oscar_export.calibration.key_bits import QUERIES, TOP

from .cache_models import PagedInt2
from .levers import PageVariant, variant


def calibration_windows(tokenizer, length: int, count: int, text: str | None = None) -> torch.Tensor:
    """``[count, length]`` consecutive token windows of the calibration text (the pydoc part the artifact is
    calibrated on, never the NIAH haystack's held-out part); any tokenizer whose call gives ``.input_ids``."""
    from oscar_export.calibration.data import pydoc_text

    ids = tokenizer(pydoc_text("calibration") if text is None else text, add_special_tokens=False).input_ids
    if len(ids) < length * count:
        raise ValueError(f"calibration_windows: {len(ids)} tokens hold fewer than {count} windows of {length}")
    return torch.tensor(ids[: length * count], dtype=torch.long).view(count, length)


@torch.no_grad()
def capture(model, ids: torch.Tensor) -> Collector:
    """The post-RoPE queries and keys of every layer for the token windows ``ids [N, T]`` (fp32, CPU)."""
    col = Collector.for_model(model, skip=0, mode="heldout")
    run_batches(model, col, [ids])
    return col


def key_attention_error(col: Collector, layer: int, cache: PagedInt2, queries: int = QUERIES, top: int = TOP
                        ) -> dict[str, float]:
    """``calibration.key_bits.key_attention_error`` of ``layer``'s keys as ``cache`` stores them (its ``page_rows``;
    its transform gives the stored basis): ``{"kl": ..., "top": ...}``, means over the last ``queries`` positions
    and every query head."""
    return key_bits.key_attention_error(col.heldout_layer(layer), cache.transforms[layer], cache.layout,
                                        lambda x: cache.page_rows(layer, x, "k", x), queries, top)


def layer_errors(col: Collector, ours: PagedInt2, bits=(2, 4), queries: int = 64) -> dict[int, list[dict]]:
    """``{bits: [error per layer]}`` (:func:`key_attention_error`): ours (2) and ours with every layer's K pages
    at ``b`` bits (``b`` > 2)."""
    n_layers = len(ours.transforms)
    out = {}
    for b in bits:
        cache = ours if b == 2 else variant(ours, f"K{b}-all", units=tuple((i, -1, "k", b) for i in range(n_layers)))
        out[b] = [key_attention_error(col, i, cache, queries) for i in range(n_layers)]
    return out


def allocate(ours: PagedInt2, errors: dict[int, list[dict]], budget_page_bits: float, metric: str = "kl",
             wide: int = 4, name: str = "", description: str = "") -> tuple[PageVariant, list[int]]:
    """``calibration.key_bits.allocate_key_bits`` on the gains ``errors[2] - errors[wide]`` of ``metric``, as a
    variant of ``ours`` (a 2-bit model) with ``wide``-bit K pages in the chosen layers. Returns the variant and
    its layers."""
    gain = [a[metric] - b[metric] for a, b in zip(errors[2], errors[wide])]
    chosen = key_bits.allocate_key_bits(gain, ours.layout, budget_page_bits, wide)
    desc = description or (f"{wide}-bit K pages in the {len(chosen)} layers whose calibration-text attention "
                           f"error ({metric}) {wide} bits reduce most (budget {budget_page_bits} page bits)")
    return variant(ours, name or f"k{wide}-{metric}-{budget_page_bits:g}", desc,
                   units=tuple((j, -1, "k", wide) for j in chosen)), chosen


__all__ = ["allocate", "calibration_windows", "capture", "key_attention_error", "layer_errors"]
