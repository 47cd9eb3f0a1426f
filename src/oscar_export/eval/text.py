"""Text metrics decode-as-deployed: perplexity, KL(p_bf16 || p_method), top-1 agreement.

Text: the LAST 30 % (by characters) of Python's ``pydoc_data.topics`` (topics sorted by name, joined by blank
lines) — available offline on every machine; calibration reads only the first 70 % (``calibration/data.py``).
It is tokenized once and cut into non-overlapping windows of ``length`` tokens from its start (``split="report"``, the
reported numbers) or its end (``split="dev"``, for tuning: windows disjoint from the report ones).

Each window is scored in ONE forward pass per method through the ``oscar_eval`` attention: position ``a``
predicts token ``a + 1`` from what the method's cache holds after token ``a`` (``cache_models``). Logits are
computed in chunks from the final hidden states, so a 49K vocabulary never materialises ``[T, V]`` twice.
Scores are kept on all positions and on the positions that read quantized history (``reads_quantized``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import EvalContext, evaluating
from .cache_models import CacheModel

#: fraction of the pydoc text that calibration may read; the evaluation reads the rest.
CALIBRATION_FRACTION = 0.7
LOGIT_CHUNK = 256


def _pydoc() -> tuple[str, int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text, int(len(text) * CALIBRATION_FRACTION)


def evaluation_text() -> str:
    """The last 30 % of the sorted pydoc topics text (disjoint from the calibration text)."""
    text, cut = _pydoc()
    return text[cut:]


def calibration_text() -> str:
    """The first 70 % (what calibration reads; the research-recipe capture uses it too)."""
    text, cut = _pydoc()
    return text[:cut]


#: where :func:`text_windows` cuts its windows: the start of the text (reported numbers) or its end (tuning).
TEXT_SPLITS = ("report", "dev")


def text_windows(tokenizer, length: int, count: int, text: str | None = None, max_positions: int | None = None,
                 split: str = "report") -> torch.Tensor:
    """``[count, length]`` token ids: consecutive non-overlapping windows of the evaluation text, from its start
    (``split="report"``) or ending at its end (``"dev"``, none of whose tokens the report windows hold).

    Raises ``ValueError`` when the text is too short for ``count`` windows (``"dev"``: for ``count`` windows past the
    report ones) or ``length`` exceeds the model's ``max_positions``.
    """
    if length < 2 or count < 1:
        raise ValueError(f"text windows: expected length >= 2 and count >= 1, got {length}, {count}")
    if split not in TEXT_SPLITS:
        raise ValueError(f"text windows: split expected one of {TEXT_SPLITS}, got {split!r}")
    if max_positions is not None and length > max_positions:
        raise ValueError(f"text windows of {length} tokens exceed the model's limit of {max_positions} positions")
    text = evaluation_text() if text is None else text
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.as_tensor(ids).view(-1)
    need = length * count
    if ids.numel() < need:
        raise ValueError(
            f"evaluation text: {count} windows of {length} tokens need {need} tokens, the text has {ids.numel()}"
            f" (use fewer windows: at most {ids.numel() // length} of {length} tokens)"
        )
    if split == "report":
        return ids[:need].view(count, length)
    if ids.numel() < 2 * need:
        raise ValueError(
            f"evaluation text: {count} dev windows of {length} tokens past the report ones need {2 * need} tokens, "
            f"the text has {ids.numel()} (use fewer windows: at most {ids.numel() // (2 * length)} of {length} tokens)"
        )
    return ids[ids.numel() - need :].view(count, length)


def max_positions(model) -> int | None:
    """The model's position limit (``max_position_embeddings``), or None when it states none."""
    return getattr(model.config, "max_position_embeddings", None)


@torch.no_grad()
def final_hidden(model, ids: torch.Tensor, method: CacheModel,
                 store_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``ids [T]`` -> final hidden states ``[T, hidden]`` with ``method``'s cache, decode-as-deployed."""
    ctx = EvalContext([method], "score", store_dtype, prefill_len=1)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    dev = next(model.parameters()).device
    with evaluating(model):
        out = base(input_ids=ids.view(1, -1).to(dev), use_cache=False, oscar_eval=ctx)
    return out.last_hidden_state[0].float()


@dataclass
class TextScore:
    """Sums over scored positions (merge windows by adding); ``*_q`` only over positions that read quantized
    history."""

    nll: float = 0.0
    kl: float = 0.0
    top1: float = 0.0
    n: int = 0
    nll_ref: float = 0.0
    nll_q: float = 0.0
    nll_ref_q: float = 0.0
    kl_q: float = 0.0
    top1_q: float = 0.0
    n_q: int = 0
    per_window_kl: list[float] = field(default_factory=list)

    def add(self, other: "TextScore") -> None:
        self.nll += other.nll
        self.kl += other.kl
        self.top1 += other.top1
        self.n += other.n
        self.nll_ref += other.nll_ref
        self.nll_q += other.nll_q
        self.nll_ref_q += other.nll_ref_q
        self.kl_q += other.kl_q
        self.top1_q += other.top1_q
        self.n_q += other.n_q
        self.per_window_kl += other.per_window_kl

    def summary(self) -> dict[str, float]:
        import math

        nq = self.n_q or float("nan")
        ppl, ppl_ref = math.exp(self.nll / self.n), math.exp(self.nll_ref / self.n)
        ppl_q = math.exp(self.nll_q / nq) if self.n_q else float("nan")
        ppl_ref_q = math.exp(self.nll_ref_q / nq) if self.n_q else float("nan")
        return {
            "ppl": ppl, "ppl_ref": ppl_ref, "dppl_pct": 100 * (ppl / ppl_ref - 1), "kl": self.kl / self.n,
            "top1": self.top1 / self.n, "positions": self.n,
            "ppl_q": ppl_q, "dppl_pct_q": 100 * (ppl_q / ppl_ref_q - 1), "kl_q": self.kl_q / nq,
            "top1_q": self.top1_q / nq, "positions_q": self.n_q,
        }


@torch.no_grad()
def compare_hidden(model, ref: torch.Tensor, got: torch.Tensor, ids: torch.Tensor,
                   quantized: torch.Tensor) -> TextScore:
    """Score ``got`` against the reference ``ref`` (both ``[T, hidden]``) on targets ``ids[1:]``.

    ``quantized [T - 1]`` bool: the positions that read quantized history (the ``*_q`` sums).
    """
    head = model.get_output_embeddings()
    return compare_logits(lambda c0, c1: head(ref[c0:c1]), lambda c0, c1: head(got[c0:c1]), ids, quantized)


@torch.no_grad()
def compare_logits(ref, got, ids: torch.Tensor, quantized: torch.Tensor) -> TextScore:
    """``ref(c0, c1)``/``got(c0, c1)`` give the logits ``[c1 - c0, V]`` of positions ``[c0, c1)``; targets
    ``ids[1:]``; ``quantized [T - 1]`` bool as in :func:`compare_hidden`."""
    return score_prefixes(ref, got, ids, quantized, [ids.numel()])[ids.numel()]


@torch.no_grad()
def score_prefixes(ref, got, ids: torch.Tensor, quantized: torch.Tensor, lengths) -> dict[int, TextScore]:
    """:func:`compare_logits` for the first ``L`` tokens of ``ids``, for every ``L`` of ``lengths`` (a causal
    model's first ``L`` positions are an ``L``-token text: one long pass scores every shorter length)."""
    return score_methods(ref, {None: (got, quantized)}, ids, lengths)[None]


@torch.no_grad()
def score_methods(ref, methods: dict, ids: torch.Tensor, lengths) -> dict:
    """:func:`score_prefixes` of several methods against one reference, whose log-probabilities are computed once
    per chunk for all of them: ``methods {name: (got, quantized)}`` -> ``{name: {L: TextScore}}`` (each method's
    numbers exactly those of its own :func:`score_prefixes` call)."""
    t = ids.numel() - 1
    for _, quantized in methods.values():
        if quantized.shape != (t,):
            raise ValueError(f"quantized: expected [{t}], got {list(quantized.shape)}")
    if any(not 2 <= L <= t + 1 for L in lengths):
        raise ValueError(f"lengths: expected 2..{t + 1}, got {list(lengths)}")
    cols = {name: {k: [] for k in ("nll", "nll_ref", "kl", "agree")} for name in methods}
    for c0 in range(0, t, LOGIT_CHUNK):
        c1 = min(c0 + LOGIT_CHUNK, t)
        lr = torch.log_softmax(ref(c0, c1).float(), -1)  # [n, V]
        tgt = ids[c0 + 1 : c1 + 1].to(lr.device)
        nll_ref = -lr.gather(1, tgt[:, None])[:, 0]
        for name, (got, _) in methods.items():
            lm = torch.log_softmax(got(c0, c1).float(), -1)
            c = cols[name]
            c["nll"].append(-lm.gather(1, tgt[:, None])[:, 0])
            c["nll_ref"].append(nll_ref)
            c["kl"].append((lr.exp() * (lr - lm)).sum(-1))
            c["agree"].append((lr.argmax(-1) == lm.argmax(-1)).double())
    return {name: _prefix_scores({k: torch.cat(v).double().cpu() for k, v in cols[name].items()},
                                 methods[name][1].cpu(), lengths) for name in methods}


def _prefix_scores(per: dict, q: torch.Tensor, lengths) -> dict[int, TextScore]:
    """``per {nll, nll_ref, kl, agree}`` ``[T - 1]`` each, ``q [T - 1]`` bool (reads INT2) -> ``{L: TextScore}``."""
    out = {}
    for L in lengths:
        n = L - 1
        far = q[:n]
        sc = TextScore(nll=float(per["nll"][:n].sum()), kl=float(per["kl"][:n].sum()),
                       top1=float(per["agree"][:n].sum()), n=n, nll_ref=float(per["nll_ref"][:n].sum()),
                       nll_q=float(per["nll"][:n][far].sum()), nll_ref_q=float(per["nll_ref"][:n][far].sum()),
                       kl_q=float(per["kl"][:n][far].sum()), top1_q=float(per["agree"][:n][far].sum()),
                       n_q=int(far.sum()))
        sc.per_window_kl.append(sc.kl / n)
        out[L] = sc
    return out


__all__ = ["CALIBRATION_FRACTION", "TextScore", "calibration_text", "compare_hidden", "compare_logits",
           "evaluation_text", "final_hidden", "max_positions", "score_methods", "score_prefixes", "text_windows"]
