"""The real-cache runs (CPU, tiny model, reference backend): the chunked feed and what it marks as reading
INT2, the cross-check plumbing, batched greedy answers equal to one-at-a-time ones."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from oscar_export.eval.deployed import deployed_niah, deployed_text, greedy_answers, oscar_logits, plain_logits
from oscar_export.eval.niah_prompts import NiahConfig, build_prompts
from oscar_export.kernels.layout import KVCacheLayout

from helpers import CharTokenizer, D, eval_transform, tiny_llama

pytest.importorskip("oscar_export.plugins.hf")


def artifact(model, lay):
    from oscar_export.calibration.artifact import OscarArtifact, model_fingerprint

    return OscarArtifact(lay, (eval_transform(seed=1), eval_transform(seed=2)), model_fingerprint(model.config))


LAY = KVCacheLayout.default(2, D, "channel", sink=16, window=32, page_size=16)
LAY = replace(LAY, key=replace(LAY.key, codebook=True), value=replace(LAY.value, codebook=True))  # learned levels


def test_chunked_feed_marks_int2_positions_and_matches_plain_inside_the_windows():
    model = tiny_llama()
    art = artifact(model, LAY)
    ids = torch.randint(0, 96, (2, 130))
    got, quantized = oscar_logits(model, art, "torch", ids, chunk=8)
    plain = plain_logits(model, ids)
    first = LAY.sink + LAY.window  # one prefill: full precision
    assert (got[:, :first] - plain[:, :first]).abs().max() < 1e-4
    assert (got[:, -1] - plain[:, -1]).abs().max() > 1e-3, "INT2 history must change the last position"
    # chunk [c0, c0 + 8) reads the pages of a c0-token cache: the first page exists from 16 + 48 + 1 = 65 on
    want = torch.tensor([LAY.split(first + (a - first) // 8 * 8)[1] > 0 if a >= first else False
                         for a in range(129)])
    assert torch.equal(quantized, want) and int(quantized.sum()) == 129 - 72
    with pytest.raises(ValueError, match="chunk"):
        oscar_logits(model, art, "torch", ids, chunk=0)


def test_deployed_text_cross_check_is_zero_for_identical_runs():
    model = tiny_llama()
    art = artifact(model, LAY)
    windows = torch.randint(0, 96, (2, 120))
    res = deployed_text({"triton": (model, "torch"), "reference": (model, "torch")}, art, windows, [60, 120],
                        chunk=16, log=lambda s: None)
    for L in ("60", "120"):
        assert res["cross"][L]["kl_triton_vs_reference"] == 0 and res["cross"][L]["kl_model_precision"] == 0
    assert res["text"]["120"]["oscar-triton"]["kl_q"] > 0 and res["text"]["120"]["oscar-triton"]["positions_q"] > 0
    assert res["text"]["60"]["oscar-triton"]["positions_q"] == 0  # 60 tokens: inside sink + window + page


def test_batched_greedy_answers_equal_one_at_a_time():
    model = tiny_llama()
    art = artifact(model, LAY)
    tok = CharTokenizer()
    cfg = NiahConfig(lengths=(640,), needles=3, tasks=("single",), digits=3)
    lines = [[i % 96 for i in range(j, j + 12)] for j in range(60)]
    prompts = build_prompts(tok, cfg, lines)
    assert len({len(p.ids) for p in prompts}) == 1, "prompts of one task and length share a token count"
    from oscar_export.plugins.hf import enable_oscar

    for make in (None, "oscar"):
        setup = enable_oscar(model, art, backend="torch") if make else None
        try:
            mk = setup.make_cache if setup else None
            batch = greedy_answers(model, tok, prompts, cfg, mk)
            alone = [greedy_answers(model, tok, [p], cfg, mk)[0] for p in prompts]
        finally:
            if setup:
                setup.restore()
        assert batch == alone, (make, batch, alone)
    res = deployed_niah({"triton": (copy.deepcopy(model), "torch")}, art, tok, prompts, cfg, log=lambda s: None)
    assert set(res["summary"]) == {"bf16-plain", "oscar-triton"} and len(res["rows"]) == 6
