"""``oscar_export/eval/driver.py``: the evaluation end to end: agreement with the real OSCAR HF cache fed token by
token, the CLI and its bad-input errors (tiny random models; SmolLM2 runs are marked model/slow)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
import transformers

from oscar_export.cli import main
from oscar_export.eval.cache_models import BF16Cache, PagedInt2
from oscar_export.eval.driver import check_device, check_lengths
from oscar_export.eval.presets import Preset
from oscar_export.eval.recipes import attention_shape
from oscar_export.eval.text import evaluation_text, final_hidden, text_windows
from oscar_export.kernels.layout import KVCacheLayout

from helpers import D, eval_transform, one_line, tiny_llama


@pytest.mark.parametrize("granularity", ["token", pytest.param("channel", marks=pytest.mark.slow)])
def test_fake_quant_agrees_with_real_hf_cache_token_by_token(granularity):
    """One fake-quantized pass == the plugins/hf OscarCache fed one token at a time (same artifact)."""
    pytest.importorskip("oscar_export.plugins.hf")
    from oscar_export.calibration.artifact import OscarArtifact, model_fingerprint
    from oscar_export.eval.deployed import oscar_logits

    model = tiny_llama()
    lay = KVCacheLayout.default(2, D, granularity, sink=16, window=32, page_size=16)
    lay = replace(lay, key=replace(lay.key, codebook=True), value=replace(lay.value, codebook=True))
    ts = (eval_transform(seed=1), eval_transform(seed=2))
    art = OscarArtifact(lay, ts, model_fingerprint(model.config))
    T = 100  # 3 pages at the end
    ids = torch.randint(0, 96, (T,))
    h = final_hidden(model, ids, PagedInt2("oscar", layout=lay, transforms=ts), torch.float32)
    fake = model.get_output_embeddings()(h)
    real, quantized = oscar_logits(model, art, "torch", ids[None], chunk=1)
    real = real[0]
    err = (real - fake).abs().max(-1).values
    worst = int(err.argmax())
    assert err.max() < 1e-3 * fake.abs().max(), f"worst position {worst}: {err[worst]:.3e}"
    base = model.get_output_embeddings()(final_hidden(model, ids, BF16Cache("bf16"), torch.float32))
    assert (base[-1] - fake[-1]).abs().max() > 100 * err.max(), "the quantized history must matter"
    pos = torch.arange(T - 1)
    assert torch.equal(quantized, PagedInt2("oscar", layout=lay, transforms=ts).reads_quantized(pos))


def test_run_eval_on_a_tiny_model_scores_every_length_and_task(monkeypatch):
    """The driver's fake-quantized path: every method scored at every text length (prefixes of one window),
    BF16 exactly 0 KL, NIAH counted per task and length."""
    from oscar_export.eval import driver, text

    from helpers import CharTokenizer

    model = tiny_llama()
    tok = CharTokenizer()
    monkeypatch.setattr(text, "evaluation_text", lambda: "x y z. " * 400)
    preset = Preset((400, 600), 1, (640,), 1, 1, 1, hf=("hf-hqq-int2",))
    res = driver.run_eval(model, tok, preset, None, ["bf16", "int2-naive", "kivi2", "hf-hqq-int2"], niah=False)
    assert set(res["text"]["lengths"]) == {"400", "600"}
    for L in ("400", "600"):
        s = res["text"]["lengths"][L]["scores"]
        assert s["bf16"]["kl"] == 0 and s["bf16"]["top1"] == 1 and s["bf16"]["positions"] == int(L) - 1
        assert s["int2-naive"]["kl"] > 0 and s["int2-naive"]["positions_q"] == int(L) - 1 - 384  # pages from 384
        assert s["kivi2"]["positions_q"] == int(L) - 1 - 127  # KIVI: the first key flush is read from position 127
    assert {m["name"] for m in res["methods"]} == {"bf16", "int2-naive", "kivi2", "hf-hqq-int2"}


# ---- bad input ---------------------------------------------------------------------------------------------------


def test_unsupported_model_is_a_clear_error():
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50)
    with pytest.raises(NotImplementedError, match=r"\(model_type 'gpt2'\) is not supported; supported model types"):
        attention_shape(transformers.GPT2LMHeadModel(cfg))  # the family table's one message


def test_family_table_models_are_accepted_and_sliding_layers_named():
    """The evaluation reads the family table: a Mistral (not in its old list) is accepted, Gemma 3's
    interleaved local layers are refused by name."""
    common = dict(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    assert attention_shape(transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))) \
        == (2, 4, 2, 16)
    gemma = transformers.Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(NotImplementedError, match=r"eval: Gemma 3 model with sliding-window attention in 1 of 2"):
        attention_shape(transformers.Gemma3ForCausalLM(gemma))


def test_text_shorter_than_the_windows_is_a_clear_error():
    class Tok:
        def __call__(self, text, return_tensors=None, add_special_tokens=False):
            return type("E", (), {"input_ids": torch.arange(len(text.split())).view(1, -1)})()

    n = len(evaluation_text().split())
    assert text_windows(Tok(), 100, 2).shape == (2, 100)
    with pytest.raises(ValueError, match=f"need {n + 1} tokens, the text has {n}"):
        text_windows(Tok(), n + 1, 1)
    with pytest.raises(ValueError, match="exceed the model's limit of 50 positions"):
        text_windows(Tok(), 100, 1, max_positions=50)


def test_length_over_the_model_limit_is_a_clear_error():
    model = tiny_llama(max_positions=1024)
    with pytest.raises(ValueError, match="NIAH length 2048 exceeds the model's limit of 1024 positions"):
        check_lengths(model, Preset((512,), 1, (1024, 2048), 1, 1, 1), text=True, niah=True)
    with pytest.raises(ValueError, match="text length 4096 exceeds the model's limit of 1024"):
        check_lengths(model, Preset((4096,), 1, (1024,), 1, 1, 1), text=True, niah=False)
    check_lengths(model, Preset((4096,), 1, (1024,), 1, 1, 1), text=False, niah=True)  # text not asked for


def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is available here"):
        check_device("cuda")
    from oscar_export.cli import main

    assert main(["eval", "--device", "cuda", "--out", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device is available" in err and err.count("\n") == 1, err


@pytest.mark.model
def test_cli_bad_lengths_fail_before_calibrating(capsys, tmp_path):
    """Over the model's 8192 positions, or more windows than the text holds: one line each, exit code 2."""
    from oscar_export.cli import main

    def error_lines():
        return [x for x in capsys.readouterr().err.splitlines() if x.startswith("oscar-export eval: error:")]

    art = ["--save-artifact", str(tmp_path / "art")]
    assert main(["eval", "--text-lengths", "16384", "--out", str(tmp_path / "o"), *art]) == 2
    (line,) = error_lines()
    assert "text length 16384 exceeds the model's limit of 8192 positions" in line
    assert main(["eval", "--text-lengths", "8192", "--text-windows", "5", "--out", str(tmp_path / "o"), *art]) == 2
    (line,) = error_lines()
    assert "5 windows of 8192 tokens need 40960 tokens, the text has" in line


def test_artifact_for_another_model_is_a_clear_error(tmp_path):
    from oscar_export.calibration.artifact import OscarArtifact, load_artifact

    other = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=D)
    OscarArtifact.identity(other).save(tmp_path / "art")
    with pytest.raises(ValueError, match="does not match this model"):
        load_artifact(str(tmp_path / "art"), tiny_llama().config)


def test_cli_rejects_bad_preset(capsys):
    from oscar_export.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--preset", "huge"])
    assert "invalid choice" in capsys.readouterr().err


def test_save_artifact_that_is_not_an_artifact_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    """The main job saves what it calibrates for the next commands; a folder of something else is not replaced."""
    import oscar_export.models as models
    from oscar_export.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "notes.txt").write_text("mine")
    assert main(["eval", "--out", str(tmp_path / "o"), "--save-artifact", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oscar-export eval: error: --save-artifact") and err.count("\n") == 1, err
    assert (tmp_path / "art" / "notes.txt").read_text() == "mine"


def test_calibration_and_evaluation_text_are_disjoint():
    from oscar_export.eval.text import calibration_text

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
def test_quick_eval_on_smollm2_without_calibration(smollm2):
    """The CLI's evaluation path on SmolLM2 (no calibration): quantized methods score worse than BF16, in order."""
    from oscar_export.eval.driver import run_eval

    model, tok = smollm2
    preset = Preset((768,), 1, (1024,), 1, 1, 512)
    res = run_eval(model, tok, preset, None, ["bf16", "int2-naive", "quarot-int2", "oscar-research"])
    s = res["text"]["lengths"]["768"]["scores"]
    assert s["bf16"]["kl"] == 0 and s["bf16"]["top1"] == 1
    assert 0 < s["quarot-int2"]["kl"] < s["int2-naive"]["kl"], s
    assert res["niah"]["summary"]["bf16"]["single"]["1024"]["n"] == 1


def test_missing_hf_backend_is_skipped_with_its_reason(monkeypatch):
    from oscar_export.eval import driver, quantizers

    monkeypatch.setattr(quantizers, "hf_backend_missing", lambda b, dev=None: "no hqq here" if b == "hqq" else None)
    model = tiny_llama(1)
    preset = Preset((512,), 1, (512,), 1, 1, 1, hf=("hf-hqq-int2", "hf-quanto-int4"))
    methods, skipped = driver.build_methods(model, None, preset, None, ["bf16", "hf-hqq-int2", "hf-quanto-int4"],
                                            log=lambda s: None)
    assert [m.name for m in methods] == ["bf16", "hf-quanto-int4"] and skipped == {"hf-hqq-int2": "no hqq here"}
    methods, skipped = driver.build_methods(model, None, preset, None, ["bf16", "kivi2"], log=lambda s: None)
    assert [m.name for m in methods] == ["bf16", "kivi2"] and skipped == {}


def test_mixed_key_bits_fake_quant_agrees_with_real_hf_cache_token_by_token():
    """An artifact with key_bits (4, 2): ``ours_method``'s fake-quantized pass == the plugins/hf
    OscarCache (reference ops, layer 0 with 4-bit K pages) fed one token at a time."""
    pytest.importorskip("oscar_export.plugins.hf")
    from oscar_export.calibration.artifact import OscarArtifact, model_fingerprint
    from oscar_export.eval.deployed import oscar_logits
    from oscar_export.eval.recipes import ours_method

    model = tiny_llama()
    lay = KVCacheLayout.default(2, D, "token", sink=16, window=32, page_size=16)
    lay = replace(lay, key=replace(lay.key, codebook=True), value=replace(lay.value, codebook=True))
    ts = (replace(eval_transform(seed=1), k_clip=torch.ones(2)), eval_transform(seed=2))
    art = OscarArtifact(lay, ts, model_fingerprint(model.config), key_bits=(4, 2))
    T = 100
    ids = torch.randint(0, 96, (T,))
    ours = ours_method(art)
    fake = model.get_output_embeddings()(final_hidden(model, ids, ours, torch.float32))
    real = oscar_logits(model, art, "torch", ids[None], chunk=1)[0][0]
    err = (real - fake).abs().max(-1).values
    worst = int(err.argmax())
    assert err.max() < 1e-3 * fake.abs().max(), f"worst position {worst}: {err[worst]:.3e}"
    two = model.get_output_embeddings()(final_hidden(model, ids, ours_method(art.with_key_bits((2, 2))), torch.float32))
    assert (two[-1] - fake[-1]).abs().max() > 100 * err.max(), "the 4-bit layer must matter"


def test_eval_unwritable_out_and_a_list_to_merge_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    import oscar_export.eval.driver as driver

    t0 = time.perf_counter()
    assert main(["eval", "--quick", "--out", "/dev/null/x"]) == 2
    assert "--out /dev/null/x: cannot create it" in one_line(capsys.readouterr().err, "eval")
    merge = tmp_path / "old.json"
    merge.write_text("[1, 2]")
    assert main(["eval", "--quick", "--out", str(tmp_path / "o"), "--merge", str(merge)]) == 2
    err = one_line(capsys.readouterr().err, "eval")
    assert "expected the JSON object of an earlier results.json" in err and "got list" in err, err
    merge.write_text("{")
    assert main(["eval", "--quick", "--out", str(tmp_path / "o"), "--merge", str(merge)]) == 2
    assert "not valid JSON" in one_line(capsys.readouterr().err, "eval")
    assert time.perf_counter() - t0 < 5
    assert driver.check_outputs is not None


# ---- --merge checked before the work, calibration bars off -------------------------------------------------------


def test_calibration_bars_turned_off_by_tqdm_disable(tmp_path, monkeypatch):
    """TQDM_DISABLE=1 gives bars without a ``desc``: the phases are told apart by name."""
    import functools

    import tqdm.auto

    import oscar_export.calibration.pipeline as pipeline
    from oscar_export.calibration.artifact import OscarArtifact
    from oscar_export.eval.driver import calibrate_and_save
    from oscar_export.eval.presets import PRESETS

    from helpers import tiny_model

    def calibrate(m, tok, cfg, progress, on_layer, on_key_bits):  # every phase's bar: capture, fit, key bits
        progress(1)
        on_layer(0, {})
        on_key_bits(1)
        return OscarArtifact.identity(m.config)

    monkeypatch.setattr(tqdm.auto, "tqdm", functools.partial(tqdm.auto.tqdm, disable=True))
    monkeypatch.setattr(pipeline, "calibrate", calibrate)
    art = calibrate_and_save(tiny_model(), None, PRESETS["quick"], str(tmp_path / "art"), [])
    assert (tmp_path / "art" / "oscar.json").is_file() and art.num_layers == 2


@pytest.mark.parametrize("methods", ["[1, 2]", "[{}]", '[{"name": "x", "description": ""}]',
                                     '[{"name": "x", "description": "", "bits": {"512": "a"}}]'])
def test_a_malformed_merge_file_is_refused_before_the_model_loads(tmp_path, capsys, no_model_load, methods):
    merge = tmp_path / "old.json"
    merge.write_text(f'{{"methods": {methods}}}')
    assert main(["eval", "--quick", "--out", str(tmp_path / "o"), "--merge", str(merge)]) == 2
    err = one_line(capsys.readouterr().err, "eval")
    assert f"--merge {merge}: not an earlier results.json: methods[0]" in err, err
