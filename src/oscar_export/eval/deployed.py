"""Accuracy of what serves: the real ``plugins/hf`` cache through ``enable_oscar``, against the same model
with its plain cache, on the same text and needles as the fake-quantized protocol.

Only the public API of the HF integration is used: ``enable_oscar(model, artifact, backend)``,
``setup.make_cache(batch_size, max_length)``, ``cache_kwargs`` and ``model(...)``.

* **Text.** Each window is fed through the real cache: the first ``S0 + W`` tokens as one prefill (full
  precision, none of them reads INT2 in any cache), then chunks of ``chunk`` tokens; a chunk reads the cache
  as stored (INT2 pages, BF16 windows) and itself causally. With ``chunk = 1`` this is token-by-token decode
  (the decode kernel: the token is appended, then attends); with ``chunk = c`` a query sees at most ``c``
  more BF16 tokens than in decode.
  The positions counted as reading INT2 are those whose chunk found pages in the cache. One pass over an
  ``L``-token window scores every shorter length too (causality).
* **NIAH.** The prompt is one prefill call (full precision), the answer is decoded greedily token by token
  from the cache, prompts of one task and length batched (they have the same token count).
* **Runs.** ``triton``: the BF16 model with the Triton kernels, as deployed; ``reference``: the fp32 model
  with the PyTorch reference ops (the cross-check); each is compared with its own model's plain cache, and
  the two OSCAR runs with each other. :func:`run_deployed` does the runs asked for and adds them to a result.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from oscar_export.calibration.families import family_for

from .niah import last_logits_only
from .niah_prompts import NiahConfig, NiahPrompt
from .niah_scoring import judge, result_row, summarize
from .presets import Preset
from .text import TextScore, score_prefixes

#: bytes the OSCAR prefill's fp32 score matrix may take (the reference prefill attention is dense).
PREFILL_SCORE_BYTES = 6 << 30


@torch.no_grad()
def plain_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``ids [B, T]`` -> ``[B, T, V]`` float32 logits with the model's own attention and no cache."""
    dev = next(model.parameters()).device
    return model(input_ids=ids.to(dev), use_cache=False).logits.float()


@torch.no_grad()
def oscar_logits(model, artifact, backend: str, ids: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B, T]`` through the real OSCAR cache -> (``[B, T, V]`` float32 logits, ``[T - 1]`` bool: the
    positions whose chunk read INT2 pages)."""
    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    if chunk < 1:
        raise ValueError(f"chunk: expected >= 1, got {chunk}")
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    b, t = ids.shape
    lay = artifact.layout  # the artifact's layout (not the setup's: only the plugin's public API is used)
    setup = enable_oscar(model, artifact, backend=backend)
    try:
        cache = setup.make_cache(batch_size=b, max_length=t)
        kw = cache_kwargs(model, cache)
        first = min(t, lay.sink + lay.window)
        bounds = [(0, first)] + [(c, min(c + chunk, t)) for c in range(first, t, chunk)]
        out, quantized = [], torch.zeros(t, dtype=torch.bool)
        for c0, c1 in bounds:
            out.append(model(input_ids=ids[:, c0:c1], use_cache=True, **kw).logits.float())
            # a chunk reads the cache as it was before it; a one-token call is a decode step (appended first)
            quantized[c0:c1] = lay.split(c0 + 1 if c1 - c0 == 1 else c0)[1] > 0
    finally:
        setup.restore()
    return torch.cat(out, 1), quantized[:-1]


def _scores(ref: torch.Tensor, got: torch.Tensor, ids: torch.Tensor, quantized: torch.Tensor, lengths) -> dict:
    """Sum over windows: ``{L: TextScore}`` of ``got`` vs ``ref`` (both ``[B, T, V]``)."""
    total = {L: TextScore() for L in lengths}
    for w in range(ids.shape[0]):
        part = score_prefixes(lambda c0, c1: ref[w, c0:c1], lambda c0, c1: got[w, c0:c1], ids[w], quantized,
                              lengths)
        for L in lengths:
            total[L].add(part[L])
    return total


@torch.no_grad()
def deployed_text(models: dict, artifact, windows: torch.Tensor, lengths, chunk: int, log=print) -> dict:
    """``models``: ``{run: (model, backend)}``, normally ``{"triton": (bf16 model, "triton"), "reference":
    (fp32 model, "torch")}``; the cross-check needs both names.

    Returns ``{"text": {L: {run: summary}}, "cross": {L: {...}}, "timings": {...}}``.
    """
    lengths = sorted(int(L) for L in lengths)
    text: dict = {str(L): {} for L in lengths}
    cross: dict = {str(L): {} for L in lengths}
    timings = {}
    oscar_out, plain_out = {}, {}
    for run, (model, backend) in models.items():
        t0 = time.perf_counter()
        plain = plain_logits(model, windows)
        got, quantized = oscar_logits(model, artifact, backend, windows, chunk)
        sync(model)
        timings[f"text_{run}_s"] = round(time.perf_counter() - t0, 1)
        for L, sc in _scores(plain, got, windows, quantized, lengths).items():
            text[str(L)][f"oscar-{run}"] = sc.summary()
        oscar_out[run], plain_out[run] = got, plain
        log(f"deployed text: {run} done in {timings[f'text_{run}_s']} s")
    both = {"triton", "reference"} <= set(oscar_out)
    if both:
        q_all = torch.ones(windows.shape[1] - 1, dtype=torch.bool)
        pairs = {"kl_triton_vs_reference": (oscar_out["reference"], oscar_out["triton"]),
                 "kl_model_precision": (plain_out["reference"], plain_out["triton"])}
        for key, (a, b) in pairs.items():
            for L, sc in _scores(a, b, windows, q_all, lengths).items():
                cross[str(L)][key] = sc.summary()["kl"]
        for L in lengths:
            cross[str(L)]["kl_triton"] = text[str(L)]["oscar-triton"]["kl"]
            cross[str(L)]["kl_reference"] = text[str(L)]["oscar-reference"]["kl"]
    return {"text": text, "cross": cross if both else {}, "chunk": chunk, "timings": timings}


def sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[NiahPrompt], cfg: NiahConfig, make_cache: Callable | None
                   ) -> list[str]:
    """Greedy answers of same-length ``prompts`` in one batch: one prefill call, then token-by-token decode.

    ``make_cache(batch, max_length)`` gives the cache (None: the model's own dynamic cache).
    """
    from oscar_export.plugins.hf import cache_kwargs

    dev = next(model.parameters()).device
    ids = torch.tensor([p.ids for p in prompts], device=dev)  # [B, n]: same-length prompts
    b, n = ids.shape
    budget = max(cfg.answer_budget(p.task) for p in prompts)
    kw = cache_kwargs(model, make_cache(b, n + budget)) if make_cache is not None else {}
    out = model(input_ids=ids, use_cache=True, **kw, **last_logits_only(model))
    if make_cache is None:
        kw = {"past_key_values": out.past_key_values}
    eos = getattr(tokenizer, "eos_token_id", None)
    toks = [[] for _ in range(b)]
    done = [False] * b
    nxt = out.logits[:, -1].argmax(-1)
    for step in range(budget):
        host = nxt.tolist()
        for i in range(b):
            if not done[i]:
                toks[i].append(host[i])
                done[i] = host[i] == eos or judge(prompts[i], tokenizer.decode(toks[i]), finished=False)[0]
        if all(done) or step == budget - 1:
            break
        out = model(input_ids=nxt.view(b, 1), use_cache=True, **kw)
        if make_cache is None:
            kw = {"past_key_values": out.past_key_values}
        nxt = out.logits[:, -1].argmax(-1)
    return [tokenizer.decode([t for t in tk if t != eos]) for tk in toks]


def prompt_batches(prompts: list[NiahPrompt], num_heads: int) -> list[list[NiahPrompt]]:
    """Prompts grouped by (task, length, token count), each group cut so the dense prefill fits
    :data:`PREFILL_SCORE_BYTES` (``[B, H, T, T]`` fp32)."""
    groups: dict = {}
    for p in prompts:
        groups.setdefault((p.task, p.length, len(p.ids)), []).append(p)
    out = []
    for (_, _, n), group in groups.items():
        per = max(1, PREFILL_SCORE_BYTES // (4 * num_heads * n * n))
        out += [group[i : i + per] for i in range(0, len(group), per)]
    return out


@torch.no_grad()
def deployed_niah(models: dict, artifact, tokenizer, prompts: list[NiahPrompt], cfg: NiahConfig,
                  plain: bool = True, log=print) -> dict:
    """NIAH through the real cache (``oscar-<run>``, ``models`` as in :func:`deployed_text`) and, with
    ``plain``, the ``triton`` run's model with its own cache (``bf16-plain``)."""
    from oscar_export.plugins.hf import enable_oscar

    rows, timings = [], {}
    runs = [(f"oscar-{run}", model, backend) for run, (model, backend) in models.items()]
    if plain and "triton" in models:
        runs.insert(0, ("bf16-plain", models["triton"][0], None))
    for name, model, backend in runs:
        t0 = time.perf_counter()
        heads = family_for(model).num_heads
        for batch in prompt_batches(prompts, heads):
            if backend is None:
                answers = greedy_answers(model, tokenizer, batch, cfg, None)
            else:
                setup = enable_oscar(model, artifact, backend=backend)
                try:
                    answers = greedy_answers(model, tokenizer, batch, cfg, setup.make_cache)
                finally:
                    setup.restore()
            rows += [result_row(p, name, a) for p, a in zip(batch, answers)]
        sync(model)
        timings[f"niah_{name}_s"] = round(time.perf_counter() - t0, 1)
        log(f"deployed NIAH: {name} done in {timings[f'niah_{name}_s']} s ({len(prompts)} prompts)")
    return {"config": cfg.to_dict(), "summary": summarize(rows), "rows": rows, "timings": timings}


def run_deployed(model, tok, preset: Preset, artifact, result: dict, text: bool, niah: bool, split: str,
                 log=print, bf16_backend: str = "triton", runs=("triton", "reference")) -> dict:
    """Ours through the real cache: the BF16 model with ``bf16_backend`` (Triton, as deployed on CUDA) and the
    fp32 model with the reference ops (the cross-check); ``runs`` names the ones to do."""
    import copy

    from .niah_prompts import build_prompts
    from .text import max_positions, text_windows

    if artifact is None:
        raise ValueError("the deployed runs need our artifact: pass --artifact or let eval calibrate")
    if not set(runs) <= {"triton", "reference"} or not runs:
        raise ValueError(f"runs: expected some of ('triton', 'reference'), got {tuple(runs)}")
    models = {"triton": (copy.deepcopy(model).to(torch.bfloat16), bf16_backend), "reference": (model, "torch")}
    models = {run: models[run] for run in ("triton", "reference") if run in runs}
    dep: dict = result.get("deployed") or {}  # a later call adds its part to an earlier one's
    dep.setdefault("timings", {})
    if text:
        windows = text_windows(tok, preset.text_lengths[-1], preset.text_windows, max_positions=max_positions(model),
                               split=split)
        dep["text_windows"] = int(windows.shape[0])
        part = deployed_text(models, artifact, windows, preset.text_lengths, preset.text_chunk, log)
        dep.update(text=part["text"], cross=part["cross"], chunk=part["chunk"])
        dep["timings"].update(part["timings"])
    if niah:
        cfg = NiahConfig(lengths=preset.niah_lengths, needles=preset.needles, split=split, tasks=preset.tasks)
        part = deployed_niah(models, artifact, tok, build_prompts(tok, cfg), cfg, log=log)
        dep["niah"] = part
        dep["timings"].update(part["timings"])
    dep["backends"] = {run: backend for run, (_, backend) in models.items()}
    models.pop("triton", None)
    result["deployed"] = dep
    return result


__all__ = ["deployed_niah", "deployed_text", "greedy_answers", "oscar_logits", "plain_logits", "prompt_batches",
           "run_deployed"]
