"""Needle-in-a-haystack retrieval (RULER-style synthetic needles), decode-as-deployed.

Haystack: RULER's "noise" filler (``FILLER`` repeated). Needles: ``"One of the special magic numbers for
{key} is: {value}."`` with a word key and a 7-digit value. The question is appended after the haystack,
the whole prompt is prefilled at FULL precision, and the answer is decoded greedily while every decode
step reads the method's cache (``EvalContext`` mode ``decode``: INT2 where the cache holds INT2).

Haystacks are *nested*: one haystack of the longest length is prefilled once (full precision, shared by
every method), and the test at length ``L`` uses its first ``cut_L`` tokens (a piece boundary, so the
prompt is ``cut_L`` + question tokens, at most ``L``). Keys and values of a causal model's first ``cut_L``
tokens do not depend on what follows, so this is exactly an ``L``-token prompt, at a fraction of the cost.

``multi``  one haystack with ``needles_per_length`` needles placed (evenly, seeded jitter) inside each
           length band ``[cut_{L-1}, cut_L)``; the test at ``L`` asks about every needle of its window,
           the others being distractors with different keys (RULER ``niah_multikey``).
``single`` haystacks with one needle each (at a seeded depth inside the shortest window), asked at every
           length (RULER ``niah_single``).

Scoring: exact match of the decoded number (first run of digits) with the needle's value. Every method
decodes in one batch (row ``b`` = method ``b``); a row stops once its number is complete or wrong.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from .eval_attention import EvalContext, evaluating
from .eval_methods import Method

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is:"
)
KEYS = (
    "apple", "river", "candle", "falcon", "marble", "violet", "harbor", "pepper", "lantern", "meadow", "copper",
    "thunder", "willow", "saddle", "glacier", "orchid", "anchor", "biscuit", "canyon", "dolphin", "ember",
    "feather", "granite", "hammock", "island", "jigsaw", "kettle", "lobster", "magnet", "nutmeg", "oyster",
    "parrot", "quartz", "rocket", "sparrow", "tulip", "velvet", "walnut", "yogurt", "zephyr",
)
PREFILL_CHUNK = 1024


@dataclass(frozen=True)
class NiahConfig:
    """Args: lengths (tokens, ascending, at most the model's limit), needles per length band (multi),
    single-needle haystacks, value digits, seed, max tokens decoded per answer."""

    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    needles_per_length: int = 4
    single_haystacks: int = 1
    digits: int = 7
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))
        if not self.lengths or list(self.lengths) != sorted(set(self.lengths)) or self.lengths[0] < 256:
            raise ValueError(f"NiahConfig.lengths: expected ascending distinct lengths >= 256, got {self.lengths}")
        if self.needles_per_length < 0 or self.single_haystacks < 0 or self.needles_per_length + self.single_haystacks == 0:
            raise ValueError("NiahConfig: needles_per_length and single_haystacks must be >= 0, not both 0")
        if not 3 <= self.digits <= 12:
            raise ValueError(f"NiahConfig.digits: expected 3..12, got {self.digits}")
        if self.needles_per_length * len(self.lengths) > len(KEYS):
            raise ValueError(f"NiahConfig: at most {len(KEYS)} needles per haystack")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Haystack:
    ids: list[int]                       # the longest prompt body (no question)
    cuts: dict[int, int]                 # length -> body tokens used at that length
    needles: list[tuple[str, str, int]]  # (key, value, token position)
    kind: str


def _tok(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def build_haystack(tokenizer, cfg: NiahConfig, kind: str, sample: int, reserve: int) -> Haystack:
    """Lay out filler sentences and needles; ``reserve`` tokens are kept free for question + answer."""
    rng = random.Random(f"{cfg.seed}-{kind}-{sample}")
    filler = _tok(tokenizer, " " + FILLER)
    cuts_target = [L - reserve for L in cfg.lengths]
    keys = rng.sample(KEYS, len(KEYS))
    plan: list[int] = []  # target token positions of needles, ascending
    if kind == "multi":
        lo = 0
        for hi in cuts_target:
            n = cfg.needles_per_length
            plan += [int(lo + (hi - lo) * (j + 0.15 + 0.7 * rng.random()) / n) for j in range(n)]
            lo = hi
    else:
        plan = [int(cuts_target[0] * (0.1 + 0.8 * rng.random()))]
    ids: list[int] = []
    needles: list[tuple[str, str, int]] = []
    cuts: dict[int, int] = {}
    li = 0
    while li < len(cfg.lengths):
        if len(needles) < len(plan) and len(ids) >= plan[len(needles)]:
            key = keys[len(needles)]
            value = str(rng.randrange(10 ** (cfg.digits - 1), 10 ** cfg.digits))
            piece = _tok(tokenizer, " " + NEEDLE.format(key=key, value=value))
            needles.append((key, value, len(ids)))
        else:
            piece = filler
        while li < len(cfg.lengths) and len(ids) + len(piece) > cuts_target[li]:
            cuts[cfg.lengths[li]] = len(ids)
            li += 1
        ids += piece
    return Haystack(ids[: cuts[cfg.lengths[-1]]], cuts, needles, kind)


@torch.no_grad()
def _forward(model, ctx: EvalContext, ids: torch.Tensor, start: int) -> torch.Tensor:
    """``ids [B, T]`` at positions ``start..`` through the oscar_eval attention -> last logits ``[B, V]``."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    pos = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    h = base(input_ids=ids, position_ids=pos, use_cache=False, oscar_eval=ctx).last_hidden_state
    return model.get_output_embeddings()(h[:, -1]).float()


def _leading_number(text: str) -> tuple[str, bool]:
    """``(digits, finished)``: the first run of digits and whether something non-digit followed it."""
    m = re.match(r"\s*(\d*)(.?)", text)
    return m.group(1), bool(m.group(2)) or (m.group(1) == "" and text.strip() != "")


@torch.no_grad()
def run_niah(model, tokenizer, methods: list[Method], cfg: NiahConfig, store_dtype=torch.bfloat16,
             progress: Callable[[str], None] | None = None) -> list[dict]:
    """Every needle query at every length for every method: ``[{kind, length, key, depth, method, answer, ok}]``."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.lengths[-1] > limit:
        raise ValueError(f"NIAH length {cfg.lengths[-1]} exceeds the model's limit of {limit} positions")
    q_len = max(len(_tok(tokenizer, QUESTION.format(key=k))) for k in KEYS)
    reserve = q_len + cfg.digits + 4
    hays = [build_haystack(tokenizer, cfg, "multi", 0, reserve)] if cfg.needles_per_length else []
    hays += [build_haystack(tokenizer, cfg, "single", s, reserve) for s in range(cfg.single_haystacks)]
    rows: list[dict] = []
    with evaluating(model):
        for hay in hays:
            ctx = EvalContext(list(methods), "prefill", store_dtype)
            body = torch.tensor(hay.ids).view(1, -1)
            for c0 in range(0, body.shape[1], PREFILL_CHUNK):
                _forward(model, ctx, body[:, c0 : c0 + PREFILL_CHUNK], c0)
                if progress:
                    progress(f"prefill {hay.kind} {c0 + PREFILL_CHUNK}/{body.shape[1]}")
            full_k, full_v = dict(ctx.prefix_k), dict(ctx.prefix_v)
            for L in cfg.lengths:
                cut = hay.cuts[L]
                for key, value, at in hay.needles:
                    if at >= cut:
                        continue
                    ctx.prefix_k, ctx.prefix_v = dict(full_k), dict(full_v)
                    ctx.crop(cut)
                    answers = _ask(model, tokenizer, ctx, key, value, cut, cfg)
                    for m, ans in zip(methods, answers):
                        digits, _ = _leading_number(ans)
                        rows.append({"kind": hay.kind, "length": L, "key": key, "depth": round(at / cut, 3),
                                     "prompt_tokens": cut + len(_tok(tokenizer, QUESTION.format(key=key))),
                                     "method": m.name, "answer": ans, "ok": digits == value})
                    if progress:
                        progress(f"{hay.kind} L={L} {key}")
    return rows


def _ask(model, tokenizer, ctx: EvalContext, key: str, value: str, cut: int, cfg: NiahConfig) -> list[str]:
    """Prefill the question at full precision, then decode every method's answer from its cache."""
    q = torch.tensor(_tok(tokenizer, QUESTION.format(key=key))).view(1, -1)
    ctx.mode = "prefill"
    first = _forward(model, ctx, q, cut).argmax(-1)  # [1]: from the full-precision prefill, as deployed
    n0 = ctx.prefix_len
    ctx.mode, ctx.prefill_len = "decode", n0
    b = len(ctx.methods)
    toks = [[int(first)] for _ in range(b)]
    done = [False] * b
    cur = first.view(1, 1).expand(b, 1).contiguous()
    for step in range(cfg.digits + 3):
        for i in range(b):
            digits, finished = _leading_number(tokenizer.decode(toks[i]))
            done[i] = finished or len(digits) > len(value) or not value.startswith(digits)
        if all(done):
            break
        nxt = _forward(model, ctx, cur, n0 + step).argmax(-1)  # [B]
        for i in range(b):
            if not done[i]:
                toks[i].append(int(nxt[i]))
        cur = nxt.view(b, 1)
    ctx.mode = "prefill"
    return [tokenizer.decode(t) for t in toks]


def summarize(rows: list[dict]) -> dict:
    """``{method: {kind: {length: accuracy}}}`` plus counts."""
    out: dict = {}
    for r in rows:
        d = out.setdefault(r["method"], {}).setdefault(r["kind"], {}).setdefault(str(r["length"]), [0, 0])
        d[0] += int(r["ok"])
        d[1] += 1
    return {m: {k: {L: {"acc": c[0] / c[1], "n": c[1]} for L, c in v.items()} for k, v in kinds.items()}
            for m, kinds in out.items()}


__all__ = ["FILLER", "NEEDLE", "QUESTION", "Haystack", "NiahConfig", "build_haystack", "run_niah", "summarize"]
