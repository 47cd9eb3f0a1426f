"""``oscar_export/calibrate.py`` (``oscar-export calibrate``): argument and input errors (one line, exit code 2, before
any model load), the atomic output, ``--device-map``, the key-width budget, and at the end the real thing on
SmolLM2-135M-Instruct (marked ``model`` and ``slow``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from oscar_export.calibration.artifact import load_artifact
from oscar_export.calibration.data import pydoc_text
from oscar_export.cli import main

from helpers import identity_artifact_with_stats


def refused_line(tmp_path, capsys, argv) -> str:
    """``oscar-export calibrate --out <tmp_path>/a *argv`` exits with code 2 and one line on stderr; returns it."""
    rc = main(["calibrate", "--out", str(tmp_path / "a"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--tokens", "100"], "100 tokens make 0 sequences of 2048"),
        (["--seq-len", "100"], "seq_len: expected >= sink \\+ page_size = 128, got 100"),
        (["--heldout", "0"], "heldout and batch_size must be >= 1"),
        (["--model", "/nonexistent/model"], "expected 'default' or a local Hugging Face model directory"),
    ],
)
def test_calibrate_bad_inputs(tmp_path, capsys, argv, msg):
    err = refused_line(tmp_path, capsys, argv)
    assert re.search(msg, err), err


def test_calibrate_bad_choice(tmp_path):
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", str(tmp_path), "--key-granularity", "row"])


# ---- every option and --out checked before the model loads; atomic output --------------------------------------


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--sink", "-1"], "--sink: expected an int in \\[0, 16384\\], got -1"),
        (["--window", "-5"], "--window: expected an int in \\[0, 65536\\], got -5"),
        (["--page-size", "24"], "--page-size: expected a multiple of 16 in \\[16, 1024\\], got 24"),
        (["--page-size", "4096"], "--page-size: expected a multiple of 16 in \\[16, 1024\\], got 4096"),
        (["--seed", "-1"], "--seed: expected an int in \\[0, "),
        (["--tokens", "10000000000000"], "--tokens: expected an int in \\[1, "),
        (["--batch-size", "100000"], "--batch-size: expected an int in \\[1, 4096\\]"),
        (["--data", "/nonexistent/notes.txt"], "--data /nonexistent/notes.txt: no such file"),
        (["--device-map", "everywhere"], "--device-map: expected one of \\['auto', 'balanced', .* got 'everywhere'"),
        (["--device-map", "{\"model.layers.0\": 0,"], "--device-map: not a JSON object"),
        (["--device-map", '{"lm_head": "gpu7"}'], "--device-map: expected devices .* got 'gpu7' for 'lm_head'"),
        (["--device-map", '{"lm_head": -1}'], "--device-map: expected devices .* got -1 for 'lm_head'"),
    ],
)
def test_calibrate_options_checked_before_model_load(tmp_path, capsys, no_model_load, argv, msg):
    err = refused_line(tmp_path, capsys, argv)
    assert re.search(msg, err), err


def test_calibrate_refuses_non_empty_out_before_model_load(tmp_path, capsys, no_model_load):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["calibrate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "already exists and is not empty" in err and "--force" in err, err
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.fixture
def fake_calibration(monkeypatch):
    """calibrate without a model: load_model returns nothing, the pipeline returns a tiny artifact."""
    import oscar_export.calibration.pipeline as pipeline
    import oscar_export.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(pipeline, "calibrate", lambda *a, **k: identity_artifact_with_stats())


def test_calibrate_replaces_an_artifact_atomically(tmp_path, capsys, monkeypatch, fake_calibration):
    import oscar_export.calibration.artifact as artifact_mod
    from oscar_export.calibration.artifact import load_artifact

    out = tmp_path / "art"
    assert main(["calibrate", "--out", str(out), "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["calibrate", "--out", str(out), "--quiet"]) == 2  # exists: refused without --force
    assert "--force" in capsys.readouterr().err

    real = artifact_mod.write_files

    def dies_half_way(directory, meta, tensors):  # the tensor file is written, then the process "dies"
        real(directory, meta, tensors)
        (Path(directory) / "oscar.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(artifact_mod, "write_files", dies_half_way)
    assert main(["calibrate", "--out", str(out), "--quiet", "--force"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "the old artifact is intact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"], "no temporary left"
    load_artifact(out)
    monkeypatch.setattr(artifact_mod, "write_files", real)
    assert main(["calibrate", "--out", str(out), "--quiet", "--force", "--seed", "3"]) == 0
    load_artifact(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_calibrate_force_keeps_the_users_files_beside_the_artifact(tmp_path, capsys, fake_calibration):
    """--force replaces the artifact, and what calibrate did not write there stays (named on stderr)."""
    out = tmp_path / "art"
    assert main(["calibrate", "--out", str(out), "--quiet"]) == 0
    (out / "NOTES.txt").write_text("n")
    (out / "runs").mkdir()
    (out / "runs" / "a.log").write_text("log")
    assert main(["calibrate", "--out", str(out), "--quiet", "--force", "--seed", "3"]) == 0
    err = capsys.readouterr().err
    assert f"--out {out}: kept what oscar-export did not write there: NOTES.txt, runs" in err, err
    assert (out / "NOTES.txt").read_text() == "n" and (out / "runs" / "a.log").read_text() == "log"
    load_artifact(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


# ---- --device-map (models larger than one GPU); on the CPU, the same artifact as a plain run --------------------


def _save_tiny_llama(path, head_dim: int = 16, heads: int = 4):
    """A random-weight Llama with a word-level tokenizer (the 200 commonest pydoc words), saved as an HF dir."""
    from collections import Counter

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from oscar_export.calibration.data import pydoc_text

    words = [w for w, _ in Counter(pydoc_text().split()).most_common(200)]
    tk = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=201, hidden_size=heads * head_dim, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


SMALL = ["--tokens", "768", "--seq-len", "96", "--heldout", "2", "--batch-size", "3", "--sink", "16", "--window", "32",
         "--page-size", "16", "--quiet", "--key-bits-budget", "none"]  # head_dim 16, P 16: 2-bit pages are 4 bits


def test_calibrate_with_a_device_map_equals_the_plain_run(tiny_model_dir, tmp_path, capsys):
    import torch

    from oscar_export.calibration.artifact import load_artifact

    layers = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    runs = {"plain": [], "cpu": ["--device-map", "cpu"], "json": ["--device-map", json.dumps(layers)]}
    arts = {}
    for name, extra in runs.items():
        rc = main(["calibrate", "--model", str(tiny_model_dir), "--out", str(tmp_path / name), *SMALL, *extra])
        assert rc == 0, capsys.readouterr().err
        arts[name] = load_artifact(tmp_path / name).tensors()
    assert "peak GPU memory" not in capsys.readouterr().out  # printed only where CUDA ran
    for name in ("cpu", "json"):
        different = [k for k in arts["plain"] if not torch.equal(arts["plain"][k], arts[name][k])]
        assert not different, (name, different[:4])


def test_calibrate_key_bits_options_checked_before_the_model_loads(tmp_path, capsys):
    err = refused_line(tmp_path, capsys, ["--key-bits-budget", "-1"])
    assert "key_bits_budget: expected None or bits per element > 0" in err, err
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", str(tmp_path / "b"), "--key-bits-metric", "mse"])
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", str(tmp_path / "c"), "--key-bits-budget", "lots"])


def test_budget_below_the_2_bit_pages_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A budget the model's 2-bit pages cannot meet: one line before the model loads (a local model: its config),
    naming the least budget and ``none``; the embedded model is checked by ``calibrate`` before its capture."""
    import oscar_export.calibration.pipeline as pipeline
    import oscar_export.models as models
    from oscar_export.calibration.config import CalibrationConfig

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the budget check"))
    err = refused_line(tmp_path, capsys, ["--model", str(tiny_model_dir), "--key-bits-budget", "2.4"])
    # head_dim 16, G = P = 64 -> groups of 16: keys 2 + 32/64, values 2 + 32/16 = 4 -> 3.25 bits per element
    assert ("key_bits_budget: 2.4 bits per element is below the 3.25 of this model's 2-bit pages "
            "(head_dim 16, page 64)") in err and "or none for 2-bit keys in every layer" in err, err
    monkeypatch.setattr(pipeline, "capture", lambda *a, **k: pytest.fail("captured before the budget check"))
    with pytest.raises(ValueError, match="2.4 bits per element is below the 3.25"):
        pipeline.calibrate(_load(tiny_model_dir), None, CalibrationConfig(key_bits_budget=2.4, seq_len=2048))


def test_budget_below_the_embedded_models_pages_refused_before_it_loads(tmp_path, capsys, monkeypatch):
    """``--model default``: the GGUF's header gives its shape in milliseconds, so a budget below its own 2-bit pages
    (2.5 bits at head_dim 64, above the 2.375 floor of any head_dim) is one line before the model loads
    (``--key-bits-budget 1.0`` and 2.4 alike)."""
    pytest.importorskip("gguf")
    import oscar_export.models as models

    try:
        models.default_model_dir()
    except ImportError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the budget check"))
    for budget in ("1.0", "2.4"):
        err = refused_line(tmp_path, capsys, ["--key-bits-budget", budget])
        # head_dim 64, page 64: keys 2 + 32/64, values 2 + 32/64 -> 2.5 bits per element
        assert f"key_bits_budget: {float(budget):g} bits per element is below the 2.5 of this model's 2-bit pages " \
               "(head_dim 64, page 64); 2.5 or more, or none" in err, err


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_key_bits_budget_3_by_default_on_long_sequences_none_is_2_bit_and_short_ones_warn(tmp_path, capsys, monkeypatch,
                                                                                          fake_calibration):
    """The default is the accurate recipe (budget 3.0 on 2,048-token sequences); ``--key-bits-budget none`` the
    all-2-bit format on the 512-token sequences it was measured with; shorter sequences with a budget warn."""
    import oscar_export.calibration.pipeline as pipeline

    seen = []
    monkeypatch.setattr(pipeline, "calibrate",
                        lambda model, tok, cfg, **k: seen.append(cfg) or identity_artifact_with_stats())
    assert main(["calibrate", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert (seen[-1].seq_len, seen[-1].key_bits_budget) == (2048, 3.0) and "warning" not in capsys.readouterr().err
    assert main(["calibrate", "--out", str(tmp_path / "b"), "--key-bits-budget", "none", "--quiet"]) == 0
    assert seen[-1].seq_len == 512 and seen[-1].key_bits_budget is None
    assert main(["calibrate", "--out", str(tmp_path / "c"), "--key-bits-budget", "3.0", "--seq-len", "512",
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert seen[-1].seq_len == 512
    assert err.count("warning: --key-bits-budget with --seq-len 512: the held-out queries read only 192 page rows") == 1


def test_key_bits_line_names_the_layers():
    from transformers import LlamaConfig

    from oscar_export.calibrate import key_bits_line
    from oscar_export.calibration.artifact import OscarArtifact

    art = OscarArtifact.identity(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             num_hidden_layers=3, head_dim=16, vocab_size=10)).with_key_bits([4, 2, 4])
    art = OscarArtifact(art.layout, art.transforms, art.fingerprint,
                        stats={"key_bits": {"budget": 3.0, "metric": "kl"}}, key_bits=art.key_bits)
    assert key_bits_line(art).startswith(
        "key bits: 4-bit keys in 2 of 3 layers [0, 2] (budget 3.0 page bits, metric kl")


# ---- the page packing is the serving GPU's (kernels.decode.select_backend), not calibrate's -----------------------


def test_an_artifact_that_carries_a_packing_still_loads_and_serves_as_linear(tmp_path_factory, tmp_path, capsys):
    """``calibrate --packing`` is gone (the server picks the pages' order); an artifact written with
    ``"packing": "mma16"`` still loads, and serves exactly as the linear artifact does."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from oscar_export.calibration.artifact import load_artifact
    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    with pytest.raises(SystemExit):
        main(["calibrate", "--out", str(tmp_path / "x"), "--packing", "mma16"])
    model_dir = _save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_d64"), head_dim=64, heads=2)
    small = list(SMALL)
    small[small.index("--page-size") + 1] = "32"  # mma16 value pages need P % 32 == 0
    rc = main(["calibrate", "--model", str(model_dir), "--out", str(tmp_path / "linear"), *small,
               "--key-bits-budget", "none"])
    assert rc == 0, capsys.readouterr().err
    import shutil

    shutil.copytree(tmp_path / "linear", tmp_path / "mma16")
    meta = json.loads((tmp_path / "mma16" / "oscar.json").read_text())
    for part in ("key", "value"):
        meta["layout"][part]["packing"] = "mma16"
    (tmp_path / "mma16" / "oscar.json").write_text(json.dumps(meta))
    arts = {p: load_artifact(tmp_path / p) for p in ("linear", "mma16")}
    assert (arts["linear"].layout.packing, arts["mma16"].layout.packing) == ("linear", "mma16")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(1, 200, (1, 150))
    logits = {}
    for packing, art in arts.items():
        with enable_oscar(model, art, backend="torch") as oscar, torch.no_grad():
            cache = oscar.make_cache(1, 200)
            assert {layer.layout.packing for layer in cache.layers} == {"linear"}
            out = model(ids, use_cache=True, **cache_kwargs(model, cache))
            nxt = model(ids[:, -1:], use_cache=True, **cache_kwargs(model, cache))
            logits[packing] = torch.cat([out.logits[0, -1:], nxt.logits[0, -1:]])
    assert torch.equal(logits["linear"], logits["mma16"])


def test_an_all_2_bit_artifact_of_the_old_default_still_loads_and_serves(tiny_model_dir, tmp_path, capsys):
    """``--key-bits-budget none`` writes what the old default wrote (no ``key_bits`` in ``oscar.json``: 2-bit keys
    everywhere); it loads, and the reference cache serves it: prefill into INT2 pages, then a decode step."""
    import torch
    from transformers import AutoModelForCausalLM

    from oscar_export.calibration.artifact import load_artifact
    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    assert main(["calibrate", "--model", str(tiny_model_dir), "--out", str(tmp_path / "a"), *SMALL]) == 0, \
        capsys.readouterr().err
    meta = json.loads((tmp_path / "a" / "oscar.json").read_text())
    assert "key_bits" not in meta and meta["config"]["key_bits_budget"] is None
    art = load_artifact(tmp_path / "a")
    assert not art.mixed_key_bits and art.layout.key.bits == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.randint(1, 200, (1, 150))
    with enable_oscar(model, art, backend="torch") as oscar, torch.no_grad():
        cache = oscar.make_cache(1, 200)
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
        nxt = model(ids[:, -1:], use_cache=True, **cache_kwargs(model, cache))
    assert [int(layer.state.num_pages[0]) for layer in cache.layers] == [art.layout.pages_for(151)] * 2
    assert art.layout.pages_for(151) > 0 and bool(torch.isfinite(out.logits).all() & torch.isfinite(nxt.logits).all())


# ---- end to end: the real thing on SmolLM2-135M-Instruct ----------------------------------------------------------
# `oscar-export calibrate` + `inspect`, then the artifact drives the HF OSCAR cache (enable_oscar) on a prompt long
# enough to have INT2 pages, from text calibration never saw. Slow (model load, capture of 30 layers, fit, a
# generation on the reference ops): one test, because each step needs the previous one's artifact.


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_calibrate_inspect_and_generate(smollm2, tmp_path, capsys):
    model, tok = smollm2
    out = tmp_path / "art"
    rc = main(["calibrate", "--model", "default", "--out", str(out), "--tokens", "2560", "--heldout", "1", "--quiet",
               "--key-bits-budget", "none"])  # the 2-bit format on 512-token sequences: a minute
    assert rc == 0
    summary = capsys.readouterr().out
    assert "wrote" in summary and "bits/element" in summary
    art = load_artifact(out, model.config)
    assert art.num_layers == 30 and art.layout.num_kv_heads == 3 and art.layout.head_dim == 64
    layers = art.stats["layers"]
    k_id = sum(x["k"]["vs_identity"] for x in layers) / 30
    v_id = sum(x["v"]["vs_identity"] for x in layers) / 30
    k_had = sum(x["k"]["vs_hadamard"] for x in layers) / 30
    print(f"held-out error vs identity K {k_id:.3f} V {v_id:.3f}; keys vs Hadamard+global clip {k_had:.3f}")
    assert k_id < 0.85 and v_id < 0.85 and k_had < 1.0

    assert main(["inspect", str(out), "--layers"]) == 0
    shown = capsys.readouterr().out
    assert "30 layers" in shown and "bits/elem" in shown and "max |R^T R - I|" in shown

    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    ids = tok(pydoc_text("evaluation")[:3000], return_tensors="pt").input_ids[:, :600]  # 600 tokens: 3 INT2 pages
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[:, 600:]
    with enable_oscar(model, str(out)) as oscar:
        cache = oscar.make_cache(1, 640)
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
        got = got[:, 600:]
    assert int(cache.layers[0].state.num_pages[0]) > 0, "the prompt must reach the INT2 pages"
    agree = int((got == want).cumprod(-1).sum())
    print(f"greedy tokens identical to the full-precision cache before the first divergence: {agree}/24")
    print("oscar:", tok.decode(got[0]))
    assert got.shape == (1, 24) and agree >= 4
