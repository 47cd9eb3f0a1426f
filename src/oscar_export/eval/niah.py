"""Needle in a haystack, scored decode-as-deployed: every prompt (``niah_prompts.py``) for every cache method.

Each prompt is prefilled at FULL precision (the model's own attention; its cache's keys and values become the
shared prefix), the first answer token comes from that prefill (as deployed), and the rest is decoded greedily
while every decode step reads each method's cache (``EvalContext`` mode ``decode``; every method one batch
row). Each answer is judged as it grows and scored at the end (``niah_scoring.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .attention import EvalContext, evaluating
from .cache_models import CacheModel
from .niah_prompts import NiahConfig, NiahPrompt
from .niah_scoring import judge, result_row


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


__all__ = ["check_lengths", "last_logits_only", "prefill", "run_niah", "same_length_batches", "watch_positions"]
