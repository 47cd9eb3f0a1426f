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

from oscar_export.calibration.capture import Collector, run_batches

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


@torch.no_grad()
def key_attention_error(col: Collector, layer: int, cache: PagedInt2, queries: int = 64, top: int = 8
                        ) -> dict[str, float]:
    """Attention error of ``layer``'s stored keys, means over the last ``queries`` positions and every query head
    (``cache``: whose ``page_rows`` store the keys; its transform gives the stored basis):

    * ``kl``: ``KL(p_bf16 || p_stored)`` over every key the query reads;
    * ``top``: ``sum |p_bf16 - p_stored|`` over the ``top`` page rows with the largest ``p_bf16`` (the few
      tokens a retrieving head attends to: a needle's digits are such rows).
    """
    h = col.heldout_layer(layer)
    q, k, scale = h.q, h.k, h.scaling
    n, hq, t, _ = q.shape
    hkv = k.shape[1]
    t_form = cache.transforms[layer]
    dev = t_form.k_clip.device
    pos = torch.arange(t - queries, t, device=dev)
    lo, hi, _ = cache.int2_ranges(pos)  # rows [lo, hi) read INT2 for the query at pos
    c0, c1 = cache.layout.sink, int(hi.max())
    if c1 <= c0:
        raise ValueError(f"key_attention_kl: {t} tokens leave no page before the last {queries} queries")
    total = {"kl": 0.0, "top": 0.0}
    for i in range(n):
        ks = t_form.transform_keys(k[i : i + 1].to(dev))[0].to(torch.bfloat16).float()  # [H_kv, T, D]
        qs = t_form.transform_queries(q[i : i + 1].to(dev))[0][:, -queries:].float()  # [H, Q, D]
        rows = cache.page_rows(layer, ks[:, c0:c1], "k", ks[:, c0:c1])
        k_hat = ks.clone()
        if rows is not None:
            k_hat[:, c0:c1] = rows
        grp = hq // hkv
        kk = ks.repeat_interleave(grp, 0)  # [H, T, D]
        kh = k_hat.repeat_interleave(grp, 0)
        s_ref = scale * qs @ kk.transpose(1, 2)  # [H, Q, T]
        col_idx = torch.arange(t, device=dev)
        stored = (col_idx[None] >= lo[:, None]) & (col_idx[None] < hi[:, None])  # [Q, T]: reads the page row
        s_got = torch.where(stored[None], scale * qs @ kh.transpose(1, 2), s_ref)
        causal = col_idx[None] <= pos[:, None]
        lp = torch.log_softmax(s_ref.masked_fill(~causal[None], float("-inf")), -1)
        lg = torch.log_softmax(s_got.masked_fill(~causal[None], float("-inf")), -1)
        p_ref, p_got = lp.exp(), lg.exp()
        kl = (p_ref * (lp - lg)).masked_fill(~causal[None], 0.0).sum(-1)  # [H, Q]
        in_pages = p_ref.masked_fill(~stored[None], -1.0)
        idx = in_pages.topk(min(top, c1 - c0), -1).indices  # [H, Q, top]: the most-attended page rows
        shift = (p_ref.gather(-1, idx) - p_got.gather(-1, idx)).abs().sum(-1)  # [H, Q]
        total["kl"] += float(kl.mean())
        total["top"] += float(shift.mean())
    return {k: v / n for k, v in total.items()}


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
    """4-bit key pages for the layers where ``wide`` bits remove the most of ``metric`` (``errors[2] -
    errors[wide]``), best first, while :meth:`PageVariant.page_bits` stays within ``budget_page_bits``. Returns
    the variant and its layers."""
    gain = [a[metric] - b[metric] for a, b in zip(errors[2], errors[wide])]
    order = sorted(range(len(gain)), key=lambda i: -gain[i])
    chosen: list[int] = []
    for i in order:
        trial = variant(ours, "probe", units=tuple((j, -1, "k", wide) for j in chosen + [i]))
        if trial.page_bits() > budget_page_bits + 1e-9:
            break
        chosen.append(i)
    desc = description or (f"{wide}-bit K pages in the {len(chosen)} layers whose calibration-text attention "
                           f"error ({metric}) {wide} bits reduce most (budget {budget_page_bits} page bits)")
    return variant(ours, name or f"k{wide}-{metric}-{budget_page_bits:g}", desc, units=tuple((j, -1, "k", wide) for j in sorted(chosen))), sorted(chosen)


__all__ = ["allocate", "calibration_windows", "capture", "key_attention_error", "layer_errors"]
