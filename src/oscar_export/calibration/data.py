"""Calibration text, available offline everywhere, cut into fixed-length token sequences.

Sources:
    ``"pydoc"``      the built-in default: Python's ``pydoc_data.topics`` (topics sorted by name, joined by
                     blank lines), FIRST 70 % of the characters only: the evaluation uses the last 30 %.
    a ``.txt`` file  plain text.
    a ``.jsonl`` file one JSON object per line; its ``"text"`` field (or the first string field) is used.
    ``"generate"``   the model's own greedy continuations of seed prompts (decode-time statistics);
                     built by :func:`generated_text`, which needs the model.

Sequences are non-overlapping windows of ``seq_len`` tokens taken at seeded random offsets from the
concatenated token stream; the first ``heldout`` sequences are set aside (used to fit clipping and pick
candidates), the rest feed the covariances. No padding: every batch is ``[B, seq_len]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: fraction of the sorted pydoc topics text calibration may read (the evaluation reads the rest).
PYDOC_CALIBRATION_FRACTION = 0.7

SEED_PROMPTS = (
    "Explain how Python's garbage collector works.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?",
    "Describe the water cycle step by step.",
    "Give three tips for writing clear documentation.",
    "How does a hash table handle collisions?",
)


def pydoc_text(part: str = "calibration") -> str:
    """The sorted pydoc topics text: ``"calibration"`` (first 70 %) or ``"evaluation"`` (last 30 %)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    cut = int(len(text) * PYDOC_CALIBRATION_FRACTION)
    if part == "calibration":
        return text[:cut]
    if part == "evaluation":
        return text[cut:]
    raise ValueError(f"pydoc_text part: expected 'calibration' or 'evaluation', got {part!r}")


def read_text_file(path: str | Path) -> str:
    """A ``.txt`` file as is, or the ``"text"`` fields of a ``.jsonl`` file joined by blank lines."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"calibration data: {p} does not exist")
    raw = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix != ".jsonl":
        return raw
    parts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(obj, str):
            parts.append(obj)
            continue
        text = obj.get("text") if isinstance(obj, dict) else None
        if text is None and isinstance(obj, dict):
            text = next((v for v in obj.values() if isinstance(v, str)), None)
        if not isinstance(text, str):
            raise ValueError(f"{p}:{n}: expected an object with a 'text' string field")
        parts.append(text)
    return "\n\n".join(parts)


@torch.no_grad()
def generated_text(model, tokenizer, prompts=SEED_PROMPTS, max_new_tokens: int = 256) -> str:
    """The model's own greedy answers to ``prompts`` (chat template when the tokenizer has one)."""
    out = []
    dev = next(model.parameters()).device
    for prompt in prompts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
                return_dict=True,
            )["input_ids"]
        else:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        gen = model.generate(ids.to(dev), max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokenizer.decode(gen[0], skip_special_tokens=True))
    return "\n\n".join(out)


def load_sources(sources: list[str], model=None, tokenizer=None) -> str:
    """Concatenate the named sources (see module doc)."""
    if not sources:
        raise ValueError("calibration data: expected at least one source ('pydoc', 'generate' or a file)")
    texts = []
    for s in sources:
        if s == "pydoc":
            texts.append(pydoc_text("calibration"))
        elif s == "generate":
            if model is None or tokenizer is None:
                raise ValueError("calibration data 'generate' needs the model and tokenizer")
            texts.append(generated_text(model, tokenizer))
        else:
            texts.append(read_text_file(s))
    return "\n\n".join(texts)


def token_sequences(
    text: str, tokenizer, seq_len: int, num_sequences: int, seed: int = 0
) -> torch.Tensor:
    """``[num_sequences, seq_len]`` int64 windows of the tokenized ``text`` at seeded random offsets.

    Windows never overlap. Raises if the text is too short for the request.
    """
    if seq_len <= 0 or num_sequences <= 0:
        raise ValueError(f"seq_len and num_sequences must be > 0, got {seq_len}, {num_sequences}")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    slots = ids.numel() // seq_len
    if slots < num_sequences:
        raise ValueError(
            f"calibration data too short: {ids.numel()} tokens hold {slots} sequences of {seq_len}, "
            f"{num_sequences} needed (lower --tokens or --seq-len, or add --data files)"
        )
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(slots, generator=g)[:num_sequences]
    windows = ids[: slots * seq_len].view(slots, seq_len)
    return windows[pick].clone()


__all__ = [
    "PYDOC_CALIBRATION_FRACTION",
    "SEED_PROMPTS",
    "generated_text",
    "load_sources",
    "pydoc_text",
    "read_text_file",
    "token_sequences",
]
