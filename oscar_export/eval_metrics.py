"""Text metrics decode-as-deployed: perplexity, KL(p_bf16 || p_method), top-1 agreement.

Text: the LAST 30 % (by characters) of Python's ``pydoc_data.topics`` (topics sorted by name, joined by blank
lines) — available offline on every machine; calibration reads only the first 70 % (``calibration/data.py``).
It is tokenized once and cut into non-overlapping windows of ``length`` tokens from its start.

Each window is scored in ONE forward pass per method through the ``oscar_eval`` attention: position ``a``
predicts token ``a + 1`` from what the method's cache holds after token ``a`` (``eval_methods``). Logits are
computed in chunks from the final hidden states, so a 49K vocabulary never materialises ``[T, V]`` twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .eval_attention import EvalContext, evaluating
from .eval_methods import Method

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


def text_windows(tokenizer, length: int, count: int, text: str | None = None) -> torch.Tensor:
    """``[count, length]`` token ids: consecutive non-overlapping windows of the evaluation text."""
    if length < 2 or count < 1:
        raise ValueError(f"text windows: expected length >= 2 and count >= 1, got {length}, {count}")
    text = evaluation_text() if text is None else text
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    need = length * count
    if ids.numel() < need:
        raise ValueError(
            f"evaluation text: {count} windows of {length} tokens need {need} tokens, the text has {ids.numel()}"
        )
    return ids[:need].view(count, length)


@torch.no_grad()
def final_hidden(model, ids: torch.Tensor, method: Method, store_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``ids [T]`` -> final hidden states ``[T, hidden]`` with ``method``'s cache, decode-as-deployed."""
    ctx = EvalContext([method], "score", store_dtype, prefill_len=1)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with evaluating(model):
        out = base(input_ids=ids.view(1, -1), use_cache=False, oscar_eval=ctx)
    return out.last_hidden_state[0].float()


@dataclass
class TextScore:
    """Sums over scored positions (merge windows by adding); ``beyond`` counts positions ``>= beyond_from``."""

    nll: float = 0.0
    kl: float = 0.0
    top1: float = 0.0
    n: int = 0
    kl_beyond: float = 0.0
    n_beyond: int = 0
    per_window_kl: list[float] = field(default_factory=list)

    def add(self, other: "TextScore") -> None:
        self.nll += other.nll
        self.kl += other.kl
        self.top1 += other.top1
        self.n += other.n
        self.kl_beyond += other.kl_beyond
        self.n_beyond += other.n_beyond
        self.per_window_kl += other.per_window_kl

    def summary(self) -> dict[str, float]:
        import math

        return {
            "ppl": math.exp(self.nll / self.n),
            "kl": self.kl / self.n,
            "top1": self.top1 / self.n,
            "kl_beyond_windows": self.kl_beyond / self.n_beyond if self.n_beyond else float("nan"),
            "positions": self.n,
        }


@torch.no_grad()
def compare_hidden(model, ref: torch.Tensor, got: torch.Tensor, ids: torch.Tensor, beyond_from: int) -> TextScore:
    """Score ``got`` against the reference ``ref`` (both ``[T, hidden]``) on targets ``ids[1:]``."""
    head = model.get_output_embeddings()
    t = ids.numel() - 1
    sc = TextScore()
    for c0 in range(0, t, LOGIT_CHUNK):
        c1 = min(c0 + LOGIT_CHUNK, t)
        lr = torch.log_softmax(head(ref[c0:c1]).float(), -1)  # [n, V]
        lm = torch.log_softmax(head(got[c0:c1]).float(), -1)
        tgt = ids[c0 + 1 : c1 + 1]
        sc.nll += float(-lm.gather(1, tgt[:, None]).sum())
        kl = (lr.exp() * (lr - lm)).sum(-1)  # [n]
        sc.kl += float(kl.sum())
        sc.top1 += float((lr.argmax(-1) == lm.argmax(-1)).sum())
        pos = torch.arange(c0, c1)
        far = pos >= beyond_from
        sc.kl_beyond += float(kl[far].sum())
        sc.n_beyond += int(far.sum())
    sc.n = t
    sc.per_window_kl.append(sc.kl / t)
    return sc


__all__ = ["CALIBRATION_FRACTION", "TextScore", "calibration_text", "compare_hidden", "evaluation_text", "final_hidden", "text_windows"]
