"""The evaluation end to end: agreement with the real OSCAR HF cache fed token by token, NIAH mechanics,
reports, the CLI and its bad-input errors (tiny random models; SmolLM2 runs are marked model/slow)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers

from oscar_export.eval_methods import Method
from oscar_export.eval_metrics import compare_hidden, evaluation_text, final_hidden, text_windows
from oscar_export.eval_recipes import attention_shape, research_recipe
from oscar_export.kernels.layout import KVCacheLayout

from test_eval_methods import D, random_transform, tiny_llama


@pytest.mark.parametrize("granularity", ["token", pytest.param("channel", marks=pytest.mark.slow)])
def test_fake_quant_agrees_with_real_hf_cache_token_by_token(granularity):
    """One fake-quantized pass == the plugins/hf OscarCache fed one token at a time (same artifact)."""
    pytest.importorskip("oscar_export.plugins.hf")
    from oscar_export.calibration.artifact import OscarArtifact, model_fingerprint
    from oscar_export.plugins.hf import enable_oscar

    model = tiny_llama()
    lay = KVCacheLayout.default(2, D, granularity, sink=16, window=32, page_size=16)
    lay = replace(lay, key=replace(lay.key, codebook=True), value=replace(lay.value, codebook=True))
    ts = (random_transform(seed=1), random_transform(seed=2))
    art = OscarArtifact(lay, ts, model_fingerprint(model.config))
    T = 100  # 3 pages at the end
    ids = torch.randint(0, 96, (T,))
    h = final_hidden(model, ids, Method("oscar", "pages", layout=lay, transforms=ts), torch.float32)
    fake = model.get_output_embeddings()(h)
    with enable_oscar(model, art) as oscar:
        cache = oscar.make_cache(batch_size=1, max_length=T)
        real = []
        with torch.no_grad():
            for a in range(T):
                out = model(input_ids=ids[None, a : a + 1], past_key_values=cache, use_cache=True)
                real.append(out.logits[0, -1])
    real = torch.stack(real)
    err = (real - fake).abs().max(-1).values
    worst = int(err.argmax())
    assert err.max() < 1e-3 * fake.abs().max(), f"worst position {worst}: {err[worst]:.3e}"
    base = model.get_output_embeddings()(final_hidden(model, ids, Method("bf16", "full"), torch.float32))
    assert (base[-1] - fake[-1]).abs().max() > 100 * err.max(), "the quantized history must matter"


def test_research_recipe_is_shared_u_h_with_global_clips():
    model = tiny_llama()
    m = research_recipe(model, torch.randint(0, 96, (2, 80)))
    t = m.transforms[0]
    assert m.param_dtype == "float32" and m.layout.key.granularity == "token"
    assert torch.equal(t.k_rotation[0], t.k_rotation[1]), "one rotation per layer, shared by the KV heads"
    eye = torch.eye(D)
    assert (t.k_rotation[0] @ t.k_rotation[0].T - eye).abs().max() < 1e-5
    assert t.k_clip.tolist() == pytest.approx([0.96, 0.96]) and t.v_clip.tolist() == pytest.approx([0.92, 0.92])
    assert m.bits_per_element(10_000) > m.layout.effective_bits_per_element(10_000)  # fp32 params cost more


@pytest.mark.model
def test_niah_haystack_layout_and_answers():
    from oscar_export.niah import NiahConfig, _leading_number, build_haystack
    from oscar_export.models import load_tokenizer

    tok = load_tokenizer()
    cfg = NiahConfig(lengths=(512, 1024), needles_per_length=3, single_haystacks=1)
    h = build_haystack(tok, cfg, "multi", 0, reserve=60)
    assert len(h.needles) == 6 and len({k for k, _, _ in h.needles}) == 6
    assert h.cuts[512] <= 512 - 60 and h.cuts[1024] <= 1024 - 60 and len(h.ids) == h.cuts[1024]
    assert sum(at < h.cuts[512] for _, _, at in h.needles) == 3
    for key, value, at in h.needles:
        assert value in tok.decode(h.ids[at : at + 40]) and key in tok.decode(h.ids[at : at + 40])
    s = build_haystack(tok, cfg, "single", 0, reserve=60)
    assert len(s.needles) == 1 and s.needles[0][2] < s.cuts[512]
    assert _leading_number(" 1234567.") == ("1234567", True)
    assert _leading_number(" 123") == ("123", False)
    assert _leading_number(" The") == ("", True)
    with pytest.raises(ValueError, match="lengths"):
        NiahConfig(lengths=(2048, 1024))


def test_niah_runs_and_bf16_equals_disabled_quantization():
    from oscar_export.niah import NiahConfig, run_niah, summarize

    model = tiny_llama()

    class Tok:  # ids are characters mod 96: enough for the mechanics
        def __call__(self, text, add_special_tokens=False, return_tensors=None):
            ids = [ord(c) % 96 for c in text]
            return type("E", (), {"input_ids": ids})()

        def decode(self, ids):
            return "".join(chr(48 + i % 10) for i in ids)

    lay = KVCacheLayout.default(2, D, sink=16, window=32, page_size=16)
    t = random_transform()
    ms = [Method("bf16", "full"), Method("off", "pages", layout=lay, transforms=[t, t], quantize=False),
          Method("on", "pages", layout=lay, transforms=[t, t])]
    rows = run_niah(model, Tok(), ms, NiahConfig(lengths=(400,), needles_per_length=2, single_haystacks=0, digits=3),
                    store_dtype=torch.float32)
    assert len(rows) >= 3 and len(rows) % 3 == 0
    by = {(r["key"], r["method"]): r["answer"] for r in rows}
    for key in {r["key"] for r in rows}:
        assert by[(key, "bf16")] == by[(key, "off")]
    assert set(summarize(rows)) == {"bf16", "off", "on"}


def test_report_writes_markdown_json_and_plots(tmp_path):
    from oscar_export.eval_report import write_all

    result = {
        "methods": [{"name": n, "kind": "x", "description": n, "bits": {"1024": b, "2048": b}}
                    for n, b in (("bf16", 16.0), ("a", 3.1))],
        "text": {"length": 1024, "scores": {"bf16": {"ppl": 10.0, "kl": 0.0, "top1": 1.0, "kl_beyond_windows": 0.0},
                                            "a": {"ppl": 11.0, "kl": 0.1, "top1": 0.9, "kl_beyond_windows": 0.2}}},
        "niah": {"config": {"lengths": [1024, 2048]},
                 "summary": {"bf16": {"multi": {"1024": {"acc": 1.0, "n": 2}}}, "a": {"multi": {"1024": {"acc": 0.5, "n": 2}}}}},
    }
    paths = write_all(result, tmp_path)
    md = paths["markdown"].read_text()
    assert "| a | 3.100 | 3.100 | 11.000 | 1.000 | 10.00 |" in md and "1/2" in md
    assert json.loads(paths["json"].read_text())["methods"][1]["name"] == "a"
    assert paths["kl_vs_bits"].stat().st_size > 1000 and paths["niah_vs_bits"].stat().st_size > 1000


def test_merge_adds_methods_and_refuses_incomparable_runs():
    from oscar_export.eval_report import merge

    def res(names, ppl=10.0, length=1024):
        return {"methods": [{"name": n, "bits": {}} for n in names], "command": "x",
                "text": {"length": length, "windows": 1, "source": "s",
                         "scores": {n: {"ppl": ppl if n == "bf16" else 11.0} for n in names}}}

    m = merge(res(["bf16", "a"]), res(["bf16", "b"]))
    assert [x["name"] for x in m["methods"]] == ["bf16", "b", "a"] and set(m["text"]["scores"]) == {"bf16", "a", "b"}
    with pytest.raises(ValueError, match="BF16 perplexity differs"):
        merge(res(["bf16", "a"]), res(["bf16", "b"], ppl=10.5))
    with pytest.raises(ValueError, match="text length differs"):
        merge(res(["bf16", "a"]), res(["bf16", "b"], length=2048))


# ---- bad input ---------------------------------------------------------------------------------------------------


def test_unsupported_model_is_a_clear_error():
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50)
    with pytest.raises(NotImplementedError, match="model_type 'gpt2' is not supported"):
        attention_shape(transformers.GPT2LMHeadModel(cfg))


def test_text_shorter_than_the_window_is_a_clear_error():
    class Tok:
        def __call__(self, text, return_tensors=None, add_special_tokens=False):
            return type("E", (), {"input_ids": torch.arange(len(text.split())).view(1, -1)})()

    n = len(evaluation_text().split())
    assert text_windows(Tok(), 100, 2).shape == (2, 100)
    with pytest.raises(ValueError, match=f"need {n + 1} tokens, the text has {n}"):
        text_windows(Tok(), n + 1, 1)


def test_artifact_for_another_model_is_a_clear_error(tmp_path):
    from oscar_export.calibration.artifact import OscarArtifact
    from oscar_export.evaluate import _load_artifact

    other = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=D)
    OscarArtifact.identity(other).save(tmp_path / "art")
    with pytest.raises(ValueError, match="does not match this model"):
        _load_artifact(str(tmp_path / "art"), tiny_llama())


def test_cli_rejects_unknown_method_and_bad_preset(tmp_path, capsys):
    from oscar_export.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--preset", "huge"])
    assert "invalid choice" in capsys.readouterr().err


def test_calibration_and_evaluation_text_are_disjoint():
    from oscar_export.eval_metrics import calibration_text

    cal, ev = calibration_text(), evaluation_text()
    from pydoc_data.topics import topics

    full = "\n\n".join(topics[k] for k in sorted(topics))
    assert cal + ev == full and len(ev) == pytest.approx(0.3 * len(full), rel=1e-3)
    try:
        from oscar_export.calibration.data import pydoc_text
    except ImportError:
        return
    assert pydoc_text("calibration") == cal and pydoc_text("evaluation") == ev


# ---- the real model ----------------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_quick_eval_on_smollm2_without_calibration(smollm2, tmp_path):
    """The CLI's evaluation path on SmolLM2 (no calibration): quantized methods score worse than BF16, in order."""
    from oscar_export.evaluate import Preset, run_eval

    model, tok = smollm2
    preset = Preset(768, 1, (1024,), 1, 0, 1, 512)
    res = run_eval(model, tok, preset, None, ["bf16", "int2-naive", "quarot-int2", "oscar-research"], niah=True,
                   text=True)
    s = res["text"]["scores"]
    assert s["bf16"]["kl"] == 0 and s["bf16"]["top1"] == 1
    assert 0 < s["quarot-int2"]["kl"] < s["int2-naive"]["kl"], s
    assert res["niah"]["summary"]["bf16"]["multi"]["1024"]["n"] == 1
