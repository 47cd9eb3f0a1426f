"""``oscar_export/eval/niah_prompts.py``: the task builder: lengths, depths, needles and their value tokens, splits."""

from __future__ import annotations

import pytest

from oscar_export.eval.niah_prompts import NEEDLE, NiahConfig, build_prompts


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
