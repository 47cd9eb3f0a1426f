"""``oscar_export/eval/niah.py``: the run: batching changes no answer, the length limit, and that the whole chain
can tell methods apart on the real model (BF16-covering windows score like BF16, noise scores near zero)."""

from __future__ import annotations

import pytest
import torch

from oscar_export.eval.cache_models import BF16Cache, Kivi2, PagedInt2
from oscar_export.eval.hf_quantized import HFQuantized
from oscar_export.eval.niah import run_niah
from oscar_export.eval.niah_prompts import NiahConfig, build_prompts
from oscar_export.eval.niah_scoring import summarize
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

from helpers import EVAL_LAYOUT, CharTokenizer, eval_transform, tiny_llama


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
