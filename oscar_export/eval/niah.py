"""Needle in a haystack (RULER-style synthetic tasks), built offline, scored decode-as-deployed.

Haystack: lines of the evaluation text (the last 30 % of Python's ``pydoc_data.topics``, see ``text.py``),
starting at a seeded line. Needles: ``"One of the special magic numbers for {key} is: {value}."`` with a word
key and a ``digits``-digit value, inserted at line boundaries. Tasks (RULER ``niah_single``,
``niah_multikey``, ``niah_multivalue``):

``single``      one needle; asked for its value.
``multikey``    the needle plus ``distractors`` needles with other keys at seeded depths; asked for one key.
``multivalue``  ``values`` needles with the same key (spread around the depth); asked for all of them.

``needles`` prompts per task and length, the asked needle at depth ``(i + 0.5) / needles`` of the haystack
(evenly spread). Two needle sets: ``split="dev"`` (for tuning) and ``split="report"`` (for reporting) differ in
every seeded choice (haystack start, keys, values, distractor depths).

Each prompt (header + haystack + question, ``length - answer budget`` tokens) is prefilled at FULL precision
(the model's own attention; its cache's keys and values become the shared prefix), the first answer token
comes from that prefill (as deployed), and the rest is decoded greedily
while every decode step reads each method's cache (``EvalContext`` mode ``decode``; every method one batch
row). Exact match: the first number of the answer equals the value (``single``/``multikey``), every value
appears among the answer's numbers (``multivalue``). Counts come with 95 % Wilson intervals.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .attention import EvalContext, evaluating
from .cache_models import CacheModel

TASKS = ("single", "multikey", "multivalue")
SPLITS = ("dev", "report")
HEADER = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
            "The special magic number for {key} mentioned in the provided text is:")
QUESTION_ALL = ("\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
                "The special magic numbers for {key} mentioned in the provided text are:")
KEYS = (
    "apple", "river", "candle", "falcon", "marble", "violet", "harbor", "pepper", "lantern", "meadow", "copper",
    "thunder", "willow", "saddle", "glacier", "orchid", "anchor", "biscuit", "canyon", "dolphin", "ember",
    "feather", "granite", "hammock", "island", "jigsaw", "kettle", "lobster", "magnet", "nutmeg", "oyster",
    "parrot", "quartz", "rocket", "sparrow", "tulip", "velvet", "walnut", "yogurt", "zephyr",
)
Z95 = 1.959963984540054


@dataclass(frozen=True)
class NiahConfig:
    """Args: lengths (tokens incl. the answer budget, ascending, at most the model's limit), needles per task
    and length, tasks (subset of ``TASKS``), split (``"dev"`` or ``"report"``), value digits, distractor
    needles (multikey), values per key (multivalue), seed."""

    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    needles: int = 20
    tasks: tuple[str, ...] = TASKS
    split: str = "report"
    digits: int = 7
    distractors: int = 3
    values: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if not self.lengths or list(self.lengths) != sorted(set(self.lengths)) or self.lengths[0] < 256:
            raise ValueError(f"NiahConfig.lengths: expected ascending distinct lengths >= 256, got {self.lengths}")
        if self.needles < 1:
            raise ValueError(f"NiahConfig.needles: expected >= 1, got {self.needles}")
        if not self.tasks or any(t not in TASKS for t in self.tasks):
            raise ValueError(f"NiahConfig.tasks: expected a subset of {TASKS}, got {self.tasks}")
        if self.split not in SPLITS:
            raise ValueError(f"NiahConfig.split: expected one of {SPLITS}, got {self.split!r}")
        if not 3 <= self.digits <= 12:
            raise ValueError(f"NiahConfig.digits: expected 3..12, got {self.digits}")
        if not 0 <= self.distractors < len(KEYS) or not 1 <= self.values <= 10:
            raise ValueError(f"NiahConfig: expected 0 <= distractors < {len(KEYS)} and 1 <= values <= 10")

    def answer_budget(self, task: str) -> int:
        """Tokens decoded at most for one answer (digits are single tokens for SmolLM2; 3 spare)."""
        return (self.values if task == "multivalue" else 1) * (self.digits + 3) + 2

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class NiahPrompt:
    """One question: ``ids`` the whole prompt (header, haystack, question); ``values`` the asked value(s);
    ``needle_at`` the token positions of the asked needles; ``value_at`` per asked needle the positions of the
    tokens that carry its value's digits; ``depth`` the asked needle's target depth."""

    task: str
    length: int
    index: int
    depth: float
    key: str
    values: list[str]
    ids: list[int]
    needle_at: list[int]
    value_at: list[list[int]] = field(default_factory=list)


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95 % Wilson score interval of ``k`` successes in ``n`` trials (``(nan, nan)`` for n = 0)."""
    if n <= 0:
        return float("nan"), float("nan")
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def _tok(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return [int(i) for i in (ids.view(-1).tolist() if hasattr(ids, "view") else ids)]


def haystack_lines(tokenizer, text: str | None = None) -> list[list[int]]:
    """The haystack text's non-empty lines, each tokenized with its newline (the pieces haystacks are cut from)."""
    if text is None:
        from .text import evaluation_text

        text = evaluation_text()
    return [_tok(tokenizer, line + "\n") for line in text.split("\n") if line.strip()]


def build_prompts(tokenizer, cfg: NiahConfig, lines: list[list[int]] | None = None) -> list[NiahPrompt]:
    """Every prompt of ``cfg``: for each task and length, ``cfg.needles`` prompts at evenly spread depths."""
    lines = haystack_lines(tokenizer) if lines is None else lines
    total = sum(len(x) for x in lines)
    header = _tok(tokenizer, HEADER)
    split_salt = SPLITS.index(cfg.split)
    out = []
    for task in cfg.tasks:
        for L in cfg.lengths:
            for i in range(cfg.needles):
                rng = random.Random(f"{cfg.seed}-{split_salt}-{task}-{L}-{i}")
                depth = (i + 0.5) / cfg.needles
                keys = rng.sample(KEYS, 1 + cfg.distractors)
                key = keys[0]
                n_vals = cfg.values if task == "multivalue" else 1
                values = [str(rng.randrange(10 ** (cfg.digits - 1), 10 ** cfg.digits)) for _ in range(n_vals)]
                while len(set(values)) < n_vals:
                    values = [str(rng.randrange(10 ** (cfg.digits - 1), 10 ** cfg.digits)) for _ in range(n_vals)]
                needles = [(depth if j == 0 else (depth + j / n_vals) % 1.0, key, v, True)
                           for j, v in enumerate(values)]
                if task == "multikey":
                    needles += [(rng.random(), k, str(rng.randrange(10 ** (cfg.digits - 1), 10 ** cfg.digits)),
                                 False) for k in keys[1:]]
                q = _tok(tokenizer, (QUESTION_ALL if task == "multivalue" else QUESTION).format(key=key))
                pieces = [(_tok(tokenizer, NEEDLE.format(key=k, value=v) + "\n"), d, asked)
                          for d, k, v, asked in needles]
                spans = [value_tokens(tokenizer, p, NEEDLE.format(key=k, value=v), v)
                         for (p, _, _), (_, k, v, asked) in zip(pieces, needles) if asked]
                budget = L - cfg.answer_budget(task) - len(header) - len(q) - sum(len(p) for p, _, _ in pieces)
                if budget < 64:
                    raise ValueError(f"NIAH length {L} leaves {budget} tokens of haystack for task {task!r}")
                if budget > total:
                    raise ValueError(f"NIAH length {L}: the haystack text has {total} tokens, {budget} needed")
                hay = _cut_haystack(lines, budget, rng.randrange(len(lines)))
                ids, at = _insert(header, hay, pieces)
                value_at = [[a + j for j in sp] for a, sp in zip(at, spans)]
                out.append(NiahPrompt(task, L, i, depth, key, values, ids + q, at, value_at))
    return out


def value_tokens(tokenizer, piece: list[int], text: str, value: str) -> list[int]:
    """Indices into ``piece`` (the tokens of ``text``) of the tokens overlapping the characters of ``value`` (its
    last occurrence in ``text``), found by decoding growing prefixes of ``piece``."""
    c0 = text.rindex(value)
    c1 = c0 + len(value)
    out, prev = [], 0
    for j in range(len(piece)):
        end = len(tokenizer.decode(piece[: j + 1]))
        if end > c0 and prev < c1:
            out.append(j)
        prev = end
    if not out:
        raise ValueError(f"NIAH: no token of the needle carries its value {value!r}")
    return out


def _cut_haystack(lines: list[list[int]], budget: int, start: int) -> list[list[int]]:
    """Lines from ``start`` (wrapping around), exactly ``budget`` tokens: whole lines, then the head of the
    next one (so every prompt of one task and length has the same token count and they can share a batch)."""
    hay, n, j = [], 0, start
    while n < budget:
        line = lines[j % len(lines)][: budget - n]
        hay.append(line)
        n += len(line)
        j += 1
    return hay


def _insert(header: list[int], hay: list[list[int]], pieces) -> tuple[list[int], list[int]]:
    """Needles into the haystack at the line boundary nearest each depth; ``(ids, asked needle positions)``,
    the positions in the order of the asked needles in ``pieces``."""
    n = sum(len(x) for x in hay)
    starts, acc = [], 0
    for line in hay:
        starts.append(acc)
        acc += len(line)
    starts.append(acc)
    slots: dict[int, list] = {}
    for order, (p, d, asked) in sorted(enumerate(pieces), key=lambda x: x[1][1]):
        b = min(range(len(starts)), key=lambda j: abs(starts[j] - d * n))
        slots.setdefault(b, []).append((p, asked, order))
    ids, at = list(header), {}
    for j in range(len(hay) + 1):
        for p, asked, order in slots.get(j, []):
            if asked:
                at[order] = len(ids)
            ids += p
        if j < len(hay):
            ids += hay[j]
    return ids, [at[k] for k in sorted(at)]


# ---- scoring ------------------------------------------------------------------------------------------------


def numbers(text: str) -> tuple[list[str], str]:
    """``(complete numbers, trailing digits)``: digit runs followed by something else, and the run still open."""
    runs = [(m.group(0), m.end()) for m in re.finditer(r"\d+", text)]
    if runs and runs[-1][1] == len(text):
        return [r for r, _ in runs[:-1]], runs[-1][0]
    return [r for r, _ in runs], ""


def judge(prompt: NiahPrompt, text: str, finished: bool = True) -> tuple[bool, bool]:
    """``(done, ok)`` for the answer decoded so far (``finished``: no more tokens will come)."""
    done_nums, open_run = numbers(text)
    if prompt.task != "multivalue":
        value = prompt.values[0]
        stripped = text.lstrip()
        if done_nums and stripped.startswith(done_nums[0]):
            return True, done_nums[0] == value
        if open_run and stripped == open_run:
            wrong = not value.startswith(open_run)
            return wrong or finished, (not wrong) and open_run == value and finished
        return bool(stripped) or finished, False  # an answer that does not start with a number is wrong
    got = set(done_nums + ([open_run] if finished and open_run else []))
    ok = all(v in got for v in prompt.values)
    return ok or finished or "\n\n" in text or len(done_nums) >= len(prompt.values), ok


def values_found(prompt: NiahPrompt, text: str) -> int:
    """How many of the asked values appear among the answer's numbers (RULER's ``string_match_all`` counts)."""
    done_nums, open_run = numbers(text)
    got = set(done_nums + ([open_run] if open_run else []))
    return sum(v in got for v in prompt.values)


# ---- the run -----------------------------------------------------------------------------------------------


@torch.no_grad()
def _forward(model, ctx: EvalContext, ids: torch.Tensor, start: int) -> torch.Tensor:
    """``ids [B, T]`` at positions ``start..`` through the oscar_eval attention -> last logits ``[B, V]``."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    dev = next(model.parameters()).device
    pos = torch.arange(start, start + ids.shape[1], device=dev).expand(ids.shape[0], -1)
    h = base(input_ids=ids.to(dev), position_ids=pos, use_cache=False, oscar_eval=ctx).last_hidden_state
    return model.get_output_embeddings()(h[:, -1]).float()


def check_lengths(model, cfg: NiahConfig) -> None:
    """A clear error when the longest NIAH length exceeds the model's position limit."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.lengths[-1] > limit:
        raise ValueError(f"NIAH length {cfg.lengths[-1]} exceeds the model's limit of {limit} positions")


@torch.no_grad()
def run_niah(model, tokenizer, methods: list[CacheModel], prompts: list[NiahPrompt], cfg: NiahConfig,
             store_dtype=torch.bfloat16, progress: Callable[[str], None] | None = None,
             batch: int = 20, max_tokens: int = 65536, needle_mass: bool = False) -> list[dict]:
    """Every prompt for every method (fake-quantized caches): ``[{task, length, index, depth, method, answer,
    ok, found}]``. Prompts of one task and length (same token count) go up to ``batch`` at a time: one
    prefill, and every method decodes all of them at once (folded into the KV heads, ``CacheModel.fold``).

    ``needle_mass``: each row also gets ``needle_mass [L][H]``: per layer and query head, the attention on the
    tokens of the asked values (``NiahPrompt.value_at``) summed over them, averaged over the decode steps that
    produced this answer's tokens (the first answer token comes from the full-precision prefill and is not
    counted; an answer of one token has no steps: ``None``)."""
    check_lengths(model, cfg)
    rows: list[dict] = []
    for group in same_length_batches(prompts, batch, max_tokens):
        ctx = EvalContext([m.fold(len(group)) for m in methods], "prefill", store_dtype, fold=len(group))
        if needle_mass:
            ctx.watch = watch_positions(group)
        first = prefill(model, ctx, torch.tensor([p.ids for p in group]))
        with evaluating(model):
            answers, active = _decode(model, tokenizer, ctx, first, group, cfg)
        masses = _mean_mass(ctx, active, len(methods), len(group)) if needle_mass else None
        for mi, m in enumerate(methods):
            for pi, pr in enumerate(group):
                rows.append(result_row(pr, m.name, answers[mi * len(group) + pi]))
                if masses is not None:
                    rows[-1]["needle_mass"] = masses[mi][pi]
        if progress:
            for pr in group:
                progress(f"{pr.task} L={pr.length} #{pr.index}")
    return rows


def watch_positions(group: list[NiahPrompt]) -> torch.Tensor:
    """``[P, W]`` long: each prompt's value-token positions (every asked needle), padded with -1."""
    pos = [[a for at in p.value_at for a in at] for p in group]
    if not all(pos):
        raise ValueError("NIAH needle mass: a prompt without value positions (NiahPrompt.value_at)")
    w = max(len(x) for x in pos)
    return torch.tensor([x + [-1] * (w - len(x)) for x in pos], dtype=torch.long)


def _mean_mass(ctx: EvalContext, active: list[list[bool]], n_methods: int, fold: int) -> list[list]:
    """``[method][prompt] -> [L][H]`` lists (or None): the recorded mass averaged over each row's active steps."""
    layers = sorted({layer for _, layer in ctx.mass})
    if not active or not layers:
        return [[None] * fold for _ in range(n_methods)]
    out = []
    for mi in range(n_methods):
        per = torch.stack([torch.stack(ctx.mass[(mi, layer)]) for layer in layers], 1).cpu()  # [S, L, fold*H]
        per = per.view(per.shape[0], len(layers), fold, -1)  # [S, L, fold, H]
        rows = []
        for pi in range(fold):
            steps = [s for s in range(per.shape[0]) if active[s][mi * fold + pi]]
            rows.append(per[steps, :, pi].mean(0).tolist() if steps else None)
        out.append(rows)
    return out


def same_length_batches(prompts: list[NiahPrompt], batch: int, max_tokens: int | None = None) -> list[list[NiahPrompt]]:
    """Prompts grouped by (task, token count), in order, at most ``batch`` (and ``max_tokens`` tokens) per group."""
    groups: dict = {}
    for p in prompts:
        groups.setdefault((p.task, len(p.ids)), []).append(p)
    out = []
    for (_, n), g in groups.items():
        size = max(1, min(batch, max_tokens // max(1, n))) if max_tokens else batch
        out += [g[i : i + size] for i in range(0, len(g), size)]
    return out


@torch.no_grad()
def prefill(model, ctx: EvalContext, ids: torch.Tensor) -> torch.Tensor:
    """Full-precision prefill of ``ids [P, T]`` (equal-length prompts) with the model's own attention; its
    post-RoPE keys and values (``DynamicCache``) become the context's prefix, the P prompts folded into the
    KV-head axis ``[1, P * H_kv, T, D]``. Returns the first answer token of each prompt ``[P]``."""
    dev = next(model.parameters()).device
    out = model(input_ids=ids.to(dev), use_cache=True, **last_logits_only(model))
    for i, layer in enumerate(out.past_key_values.layers):
        k, v = layer.keys, layer.values  # [P, H_kv, T, D]
        ctx.prefix_k[i] = k.reshape(1, -1, *k.shape[2:])
        ctx.prefix_v[i] = v.reshape(1, -1, *v.shape[2:])
    return out.logits[:, -1].float().argmax(-1)


def last_logits_only(model) -> dict:
    """``{"logits_to_keep": 1}`` where the model's forward takes it (a long prefill needs one logit row)."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def result_row(pr: NiahPrompt, method: str, answer: str) -> dict:
    _, ok = judge(pr, answer, finished=True)
    return {"task": pr.task, "length": pr.length, "index": pr.index, "depth": round(pr.depth, 4),
            "prompt_tokens": len(pr.ids), "needle_at": pr.needle_at, "values": pr.values, "method": method,
            "answer": answer, "ok": ok, "found": values_found(pr, answer)}


def _decode(model, tokenizer, ctx: EvalContext, first: torch.Tensor, group: list[NiahPrompt], cfg: NiahConfig
            ) -> tuple[list[str], list[list[bool]]]:
    """Every (method, prompt)'s answer, row ``method * P + prompt``: the first token from the full-precision
    prefill, the rest decoded from each method's cache; and per decode step which rows it decoded for."""
    n0, f = ctx.prefix_len, ctx.fold
    ctx.mode, ctx.prefill_len = "decode", n0
    b = len(ctx.methods) * f
    prompt_of = [group[r % f] for r in range(b)]
    firsts = first.tolist()
    toks = [[firsts[r % f]] for r in range(b)]
    done = [False] * b
    active: list[list[bool]] = []
    cur = first.view(1, f).expand(len(ctx.methods), f).reshape(b, 1).contiguous()
    budget = max(cfg.answer_budget(p.task) for p in group)
    eos = getattr(tokenizer, "eos_token_id", None)
    for step in range(budget - 1):
        for i in range(b):
            done[i] = done[i] or toks[i][-1] == eos or judge(prompt_of[i], tokenizer.decode(toks[i]), finished=False)[0]
        if all(done):
            break
        active.append([not d for d in done])
        nxt = _forward(model, ctx, cur, n0 + step).argmax(-1)  # [B]
        host = nxt.tolist()
        for i in range(b):
            if not done[i]:
                toks[i].append(host[i])
        cur = nxt.view(b, 1)
    return [tokenizer.decode([t for t in tk if t != eos]) for tk in toks], active


def summarize(rows: list[dict]) -> dict:
    """``{method: {task: {length: {ok, n, acc, lo, hi, found, asked, recall, recall_lo, recall_hi}}}}``.

    ``ok``/``n``: exact answers (every value, for multivalue) with the 95 % Wilson interval ``lo``/``hi``;
    ``found``/``asked``: values recalled (RULER's multivalue score), Wilson over values (values of one prompt
    are correlated: that interval is narrower than the truth).
    """
    counts: dict = {}
    for r in rows:
        c = counts.setdefault(r["method"], {}).setdefault(r["task"], {}).setdefault(str(r["length"]), [0, 0, 0, 0])
        c[0] += int(r["ok"])
        c[1] += 1
        c[2] += int(r.get("found", int(r["ok"])))
        c[3] += len(r.get("values", [None]))
    out: dict = {}
    for m, tasks in counts.items():
        for t, lens in tasks.items():
            for L, (k, n, f, a) in lens.items():
                lo, hi = wilson(k, n)
                rlo, rhi = wilson(f, a)
                out.setdefault(m, {}).setdefault(t, {})[L] = {"ok": k, "n": n, "acc": k / n, "lo": lo, "hi": hi,
                                                             "found": f, "asked": a, "recall": f / a,
                                                             "recall_lo": rlo, "recall_hi": rhi}
    return out


__all__ = ["HEADER", "KEYS", "NEEDLE", "QUESTION", "QUESTION_ALL", "SPLITS", "TASKS", "NiahConfig", "NiahPrompt",
           "build_prompts", "check_lengths", "haystack_lines", "judge", "last_logits_only", "numbers", "result_row",
           "run_niah", "same_length_batches", "value_tokens", "values_found", "watch_positions",
           "summarize", "wilson"]
