"""Needle in a haystack (RULER-style synthetic tasks): the prompts, built offline from the evaluation text.

Haystack: lines of the evaluation text (the last 30 % of Python's ``pydoc_data.topics``, see ``text.py``),
starting at a seeded line. Needles: ``"One of the special magic numbers for {key} is: {value}."`` with a word
key and a ``digits``-digit value, inserted at line boundaries. Tasks (RULER ``niah_single``,
``niah_multikey``, ``niah_multivalue``):

``single``      one needle; asked for its value.
``multikey``    the needle plus ``distractors`` needles with other keys at seeded depths; asked for one key.
``multivalue``  ``values`` needles with the same key (spread around the depth); asked for all of them.

``needles`` prompts per task and length, the asked needle at depth ``(i + 0.5) / needles`` of the haystack
(evenly spread). Two needle sets: ``split="dev"`` (for tuning) and ``split="report"`` (for reporting) differ in
every seeded choice (haystack start, keys, values, distractor depths). Each prompt is header + haystack + question,
``length - answer budget`` tokens. Scoring: ``niah_scoring.py``; the run: ``niah.py``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

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


__all__ = ["HEADER", "KEYS", "NEEDLE", "QUESTION", "QUESTION_ALL", "SPLITS", "TASKS", "NiahConfig", "NiahPrompt",
           "build_prompts", "haystack_lines", "value_tokens"]
