"""End to end on a tiny random Llama (mechanics only: random weights prove nothing about accuracy)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oscar_export.calibration.artifact import load_artifact
from oscar_export.calibration.data import pydoc_text, read_text_file, token_sequences
from oscar_export.calibration.pipeline import CalibrationConfig, calibrate


class CharTokenizer:
    """Bytes as token ids (enough for the data path; no vocabulary files needed)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        return {"input_ids": torch.tensor([[b % self.vocab for b in text.encode()]])}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=96, vocab_size=256, head_dim=16, rope_theta=1000.0)
    return LlamaForCausalLM(cfg).eval()


def small_cfg(**kw) -> CalibrationConfig:
    base = dict(tokens=8 * 96, seq_len=96, heldout=2, batch_size=3, sink=16, window=32, page_size=16)
    base.update(kw)
    return CalibrationConfig(**base)


@pytest.mark.parametrize("kw", [{}, {"key_granularity": "token", "per_head": False, "codebook": "auto"},
                                {"rotation": "oscar", "clip": "global", "value_weighting": "research"}])
def test_calibrate_tiny_model(tiny, tmp_path, kw):
    cfg = small_cfg(**kw)
    seen = []
    art = calibrate(tiny, CharTokenizer(256), cfg, on_layer=lambda i, s: seen.append(i))
    assert seen == [0, 1] and art.num_layers == 2
    assert art.layout.key.granularity == cfg.key_granularity and art.layout.sink == 16
    art.save(tmp_path)
    back = load_artifact(tmp_path, tiny.config)
    assert back.config["rotation"] == cfg.rotation and back.stats["layers"][1]["k"]["rotation"]
    for layer in back.stats["layers"]:
        for side in "kv":
            s = layer[side]
            # identity without clipping is always among what the fit can choose (auto) or it was beaten
            if cfg.rotation == "auto" and cfg.clip == "fitted":
                assert s["error"] <= s["baselines"]["identity"] * (1 + 1e-9)
            assert s["error"] > 0 and len(s["clip"]) == 2
    if not cfg.per_head:
        for t in back.transforms:
            assert torch.equal(t.k_rotation[0], t.k_rotation[1]) and torch.equal(t.k_clip[0], t.k_clip[1])
    json.dumps(back.stats)  # JSON-clean


def test_config_validation():
    with pytest.raises(ValueError, match="rotation: expected one of"):
        small_cfg(rotation="svd")
    with pytest.raises(ValueError, match="clip: expected one of"):
        small_cfg(clip="auto")
    with pytest.raises(ValueError, match="seq_len: expected >= sink \\+ page_size = 32, got 24"):
        small_cfg(seq_len=24)
    with pytest.raises(ValueError, match="need more than the 2 held-out ones"):
        small_cfg(tokens=2 * 96)
    with pytest.raises(ValueError, match="scale='whiten' needs a fixed rotation"):
        small_cfg(scale="whiten")
    with pytest.raises(ValueError, match="value_weighting: expected one of"):
        small_cfg(value_weighting="softmax")
    assert small_cfg().objective_window == 32 and small_cfg(seq_len=48).objective_window == 0


def test_data_sources(tmp_path):
    cal, ev = pydoc_text("calibration"), pydoc_text("evaluation")
    assert abs(len(cal) / (len(cal) + len(ev)) - 0.7) < 1e-3 and cal[-50:] not in ev
    with pytest.raises(ValueError, match="part: expected"):
        pydoc_text("test")
    j = tmp_path / "d.jsonl"
    j.write_text('{"text": "hello"}\n\n{"id": 1, "body": "world"}\n"plain"\n')
    assert read_text_file(j) == "hello\n\nworld\n\nplain"
    j.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match="d.jsonl:2: not valid JSON"):
        read_text_file(j)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text_file(tmp_path / "missing.txt")
    tok = CharTokenizer(256)
    seqs = token_sequences("abcdefgh" * 10, tok, 8, 5, seed=1)
    assert seqs.shape == (5, 8) and len({tuple(s.tolist()) for s in seqs}) == 1  # periodic text
    with pytest.raises(ValueError, match="calibration data too short: 80 tokens hold 10 sequences of 8, 11 needed"):
        token_sequences("abcdefgh" * 10, tok, 8, 11)


def test_non_power_of_two_head_dim_falls_back(tmp_path):
    """head_dim 48: 'auto' drops the Hadamard kinds (documented fallback); a fixed Hadamard is a clear error."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=256, head_dim=48)
    model = LlamaForCausalLM(cfg).eval()
    art = calibrate(model, CharTokenizer(256), small_cfg())
    s = art.stats["layers"][0]
    assert s["k"]["vs_hadamard"] is None and "hadamard+clip" not in s["k"]["baselines"]
    assert not any("hadamard" in c or "oscar" in c for c in s["k"]["rotation"] + s["v"]["rotation"])
    art.save(tmp_path)
    load_artifact(tmp_path, model.config)
    with pytest.raises(NotImplementedError, match="power of two, got 48"):
        calibrate(model, CharTokenizer(256), small_cfg(rotation="hadamard"))


def test_device_map_with_hooks_gives_the_plain_artifact(tiny):
    """A model dispatched by accelerate (hooks on every layer, as ``--device-map`` loads it) calibrates to the same
    tensors as the plain model. On the CPU only: the multi-GPU run is benchmarks/calibrate_tp.py --small (untested)."""
    import copy

    accelerate = pytest.importorskip("accelerate")
    plain = calibrate(tiny, CharTokenizer(256), small_cfg())
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    hooked = accelerate.dispatch_model(copy.deepcopy(tiny), device_map, main_device="cpu", force_hooks=True)
    assert all(hasattr(layer, "_hf_hook") for layer in hooked.model.layers)  # the collector passes through hooks
    mapped = calibrate(hooked, CharTokenizer(256), small_cfg())
    a, b = plain.tensors(), mapped.tensors()
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:4]


def test_calibrate_gives_four_bit_keys_within_the_budget(tiny, tmp_path):
    base = small_cfg().layout(2, 16)
    one = (base.int2_bits_per_element() + base.with_key_bits(4).int2_bits_per_element()) / 2  # 1 of 2 layers
    art = calibrate(tiny, CharTokenizer(256), small_cfg(key_bits_budget=one, key_bits_metric="top"))
    kb = art.stats["key_bits"]
    assert kb["budget"] == one and kb["metric"] == "top" and len(kb["errors"]) == 2
    gains = [e["2"]["top"] - e["4"]["top"] for e in kb["errors"]]
    best = max(range(2), key=lambda i: gains[i])
    assert art.key_bits == tuple(4 if i == best else 2 for i in range(2)) and kb["layers"] == [best]
    for i, t in enumerate(art.transforms):  # each layer stores the key clips its width was measured with
        assert t.k_clip.tolist() == kb["errors"][i][str(art.key_bits[i])]["clip"], i
    assert art.bits_per_element() == pytest.approx(one)
    art.save(tmp_path)
    assert load_artifact(tmp_path, tiny.config).key_bits == art.key_bits
    assert calibrate(tiny, CharTokenizer(256), small_cfg()).key_bits == (2, 2)


def test_layers_fitted_side_by_side_give_the_artifact_of_one_at_a_time(tiny):
    """``fit_threads`` layers fitted (and their key widths measured) at once, each on one torch thread: the same
    transforms, key widths and held-out statistics as one layer at a time; torch's thread count restored."""
    base = small_cfg().layout(2, 16)
    cfg = small_cfg(key_bits_budget=(base.int2_bits_per_element() + base.with_key_bits(4).int2_bits_per_element()) / 2)
    threads = torch.get_num_threads()
    one, two = (calibrate(tiny, CharTokenizer(256), cfg, fit_threads=n) for n in (1, 2))
    assert torch.get_num_threads() == threads
    assert one.key_bits == two.key_bits and len(one.key_bits) == 2
    for a, b in zip(one.transforms, two.transforms):
        for name in ("k_rotation", "v_rotation", "k_clip", "v_clip", "k_mean", "v_mean", "k_scale", "v_scale"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert one.stats["layers"] == two.stats["layers"] and one.stats["key_bits"] == two.stats["key_bits"]


def test_key_bits_config_validation():
    with pytest.raises(ValueError, match="key_bits_metric: expected one of"):
        small_cfg(key_bits_metric="mse")
    for bad in (0.0, -1.0, float("inf"), True, "3"):
        with pytest.raises(ValueError, match="key_bits_budget: expected None or bits per element > 0"):
            small_cfg(key_bits_budget=bad)
    with pytest.raises(ValueError, match=r"read no page unless seq_len > sink \+ window \+ page_size = 64, got 64"):
        small_cfg(seq_len=64, key_bits_budget=3.0)
