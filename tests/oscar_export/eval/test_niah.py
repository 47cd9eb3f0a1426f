"""NIAH: the task builder (lengths, depths, splits), the scorer, Wilson intervals, and that the whole chain
can tell methods apart on the real model (BF16-covering windows score like BF16, noise scores near zero)."""

from __future__ import annotations

import pytest
import torch

from oscar_export.eval.cache_models import BF16Cache, HFQuantized, Kivi2, PagedInt2
from oscar_export.eval.niah import (
    NEEDLE,
    NiahConfig,
    NiahPrompt,
    build_prompts,
    judge,
    numbers,
    run_niah,
    summarize,
    values_found,
    wilson,
)
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

from helpers import EVAL_LAYOUT, CharTokenizer, eval_transform, tiny_llama


def prompt(task="single", values=("2531545",)):
    return NiahPrompt(task, 1024, 0, 0.5, "apple", list(values), [], [])


def test_judge_single_exact_leading_number():
    p = prompt()
    assert judge(p, " 2531545.") == (True, True)
    assert judge(p, " 253.") == (True, False)  # truncated (issue 17's failure)
    assert judge(p, " 2531546") == (True, False)
    assert judge(p, " 253", finished=False) == (False, False)  # still a prefix: keep decoding
    assert judge(p, " 254", finished=False) == (True, False)  # no longer a prefix: stop
    assert judge(p, " The number is 2531545.") == (True, False)  # must answer with the number
    assert judge(p, " 25315450") == (True, False)


def test_judge_multivalue_needs_every_value():
    p = prompt("multivalue", ("1111111", "2222222", "3333333"))
    assert judge(p, " 1111111, 3333333, 2222222.") == (True, True)
    assert judge(p, " 1111111, 3333333 and", finished=False) == (False, False)
    assert judge(p, " 1111111, 3333333.") == (True, False)
    assert judge(p, " 1111111, 3333333, 4444444, ", finished=False)[0]  # as many numbers as values: stop
    assert values_found(p, " 1111111, 3333333, 4444444.") == 2
    assert numbers(" 12, 345") == (["12"], "345")


def test_wilson_interval_known_values():
    lo, hi = wilson(10, 20)
    assert lo == pytest.approx(0.2993, abs=1e-4) and hi == pytest.approx(0.7007, abs=1e-4)
    assert wilson(0, 20)[0] == 0 and wilson(0, 20)[1] == pytest.approx(0.1611, abs=1e-4)
    assert wilson(20, 20)[1] == 1 and wilson(20, 20)[0] == pytest.approx(0.8389, abs=1e-4)
    s = summarize([{"method": "m", "task": "single", "length": 1024, "ok": i < 10} for i in range(20)])
    c = s["m"]["single"]["1024"]
    assert (c["ok"], c["n"], c["acc"]) == (10, 20, 0.5) and c["lo"] == pytest.approx(lo)


@pytest.mark.model
def test_prompts_have_the_length_depth_and_needles_asked_for():
    from oscar_export.models import load_tokenizer

    tok = load_tokenizer()
    cfg = NiahConfig(lengths=(512, 1024), needles=5, split="report")
    prompts = build_prompts(tok, cfg)
    assert len(prompts) == 3 * 2 * 5
    for p in prompts:
        assert len(p.ids) == p.length - cfg.answer_budget(p.task), (p.task, p.length, len(p.ids))
        assert len(p.needle_at) == len(p.values) == (cfg.values if p.task == "multivalue" else 1)
        assert len(p.value_at) == len(p.values)
        for at, v, vat in zip(p.needle_at, p.values, p.value_at):
            text = tok.decode(p.ids[at : at + 30])
            assert text.startswith(NEEDLE.format(key=p.key, value=v)), text
            assert tok.decode([p.ids[j] for j in vat]).strip() == v, (v, vat, tok.decode([p.ids[j] for j in vat]))
            assert vat == list(range(vat[0], vat[-1] + 1)) and vat[0] > at
        body = len(p.ids) - 40  # the question is ~40 tokens; depth is relative to the haystack
        assert abs(p.needle_at[0] / body - p.depth) < 0.15, (p.task, p.index, p.needle_at[0], body, p.depth)
        if p.task == "multikey":
            assert tok.decode(p.ids).count("One of the special magic numbers for") == 1 + cfg.distractors
    depths = sorted({p.depth for p in prompts})
    assert depths == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    dev = build_prompts(tok, NiahConfig(lengths=(512,), needles=5, split="dev", tasks=("single",)))
    rep = [p for p in prompts if p.task == "single" and p.length == 512]
    assert all(a.values != b.values and a.ids != b.ids for a, b in zip(dev, rep)), "dev and report must differ"
    again = build_prompts(tok, NiahConfig(lengths=(512,), needles=5, split="dev", tasks=("single",)))
    assert [p.ids for p in again] == [p.ids for p in dev], "the sets are seeded"


def test_niah_runs_bf16_equals_disabled_quantization_and_batching_changes_nothing():
    """Prompts decoded together (folded into the KV heads) give each prompt's answers alone, for every kind of
    cache (per-head transforms tiled, KIVI, the HF replay per prompt)."""
    model = tiny_llama()
    t = eval_transform()
    ms = [BF16Cache("bf16"), PagedInt2("off", layout=EVAL_LAYOUT, transforms=(t, t), quantize=False),
          PagedInt2("on", layout=EVAL_LAYOUT, transforms=(t, t)), Kivi2("kivi", group=16, residual=32),
          HFQuantized("hf", backend="hqq", residual=16)]
    cfg = NiahConfig(lengths=(640,), needles=3, tasks=("single", "multivalue"), digits=3, values=2)
    lines = [[i % 96 for i in range(j, j + 12)] for j in range(60)]
    tok = CharTokenizer()
    prompts = build_prompts(tok, cfg, lines)
    rows = run_niah(model, tok, ms, prompts, cfg, store_dtype=torch.float32, batch=3)
    assert len(rows) == 5 * len(prompts) == 30
    by = {(r["task"], r["index"], r["method"]): r["answer"] for r in rows}
    for task, i, _ in by:
        assert by[(task, i, "bf16")] == by[(task, i, "off")]
    alone = run_niah(model, tok, ms, prompts, cfg, store_dtype=torch.float32, batch=1)
    assert {(r["task"], r["index"], r["method"]): r["answer"] for r in alone} == by
    assert set(summarize(rows)) == {"bf16", "off", "on", "kivi", "hf"}


def test_niah_length_over_the_model_limit_is_a_clear_error():
    model = tiny_llama(max_positions=512)
    cfg = NiahConfig(lengths=(1024,), needles=1)
    with pytest.raises(ValueError, match="NIAH length 1024 exceeds the model's limit of 512 positions"):
        run_niah(model, CharTokenizer(), [BF16Cache("bf16")], [], cfg)


@pytest.mark.model
def test_scorer_tells_bf16_from_noise_on_smollm2(smollm2):
    """If the builder or the scorer were wrong, these could not both hold: windows covering the whole prompt
    give exactly BF16's answers and BF16 finds the needles; INT2 rows replaced by noise find (almost) none."""
    model, tok = smollm2
    cfg = NiahConfig(lengths=(1024,), needles=3, tasks=("single", "multikey"))
    prompts = build_prompts(tok, cfg)
    lay_all = KVCacheLayout.default(3, 64, "channel", sink=64, window=1024, page_size=64)  # windows hold 1024+
    lay_small = KVCacheLayout.default(3, 64, "channel", sink=16, window=32, page_size=16)
    n = model.config.num_hidden_layers
    ident = tuple(LayerTransform.identity(3, 64) for _ in range(n))
    ms = [BF16Cache("bf16"), PagedInt2("covering", layout=lay_all, transforms=ident),
          PagedInt2("noise", layout=lay_small, transforms=ident, noise=True)]
    rows = run_niah(model, tok, ms, prompts, cfg)
    s = summarize(rows)
    ok = {m: sum(c["ok"] for t in s[m].values() for c in t.values()) for m in s}
    answers = {(r["task"], r["index"], r["method"]): r["answer"] for r in rows}
    assert all(answers[(t, i, "bf16")] == answers[(t, i, "covering")] for t, i, _ in answers)
    bf16 = [(r["values"], r["answer"]) for r in rows if r["method"] == "bf16"]
    assert ok["bf16"] >= 5, f"BF16 found {ok['bf16']}/6: {bf16}"
    assert ok["noise"] <= 1, f"noise found {ok['noise']}/6: {[r['answer'] for r in rows if r['method'] == 'noise']}"


def test_same_length_batches_bound_the_tokens_per_group():
    """20 prompts of 8K for 12 methods ran out of the H200's memory: groups hold at most max_tokens tokens."""
    from types import SimpleNamespace

    from oscar_export.eval.niah import same_length_batches

    prompts = [SimpleNamespace(task="single", ids=[0] * 8192) for _ in range(20)]
    prompts += [SimpleNamespace(task="single", ids=[0] * 1024) for _ in range(20)]
    groups = same_length_batches(prompts, 20, 65536)
    assert [len(g) for g in groups] == [8, 8, 4, 20]
    assert [len(g) for g in same_length_batches(prompts, 20)] == [20, 20]
