"""``calibration/pipeline.py``: end to end on a tiny random Llama (mechanics only: random weights prove nothing
about accuracy), and one layer's fit on planted-structure attention data (``helpers.planted``): the calibrated
transform beats identity and Hadamard on the attention-aware held-out error, per-head beats shared when the heads
disagree, and value clips sit one grid step milder than their fit."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oscar_export.calibration.artifact import load_artifact
from oscar_export.calibration.clipping import clip_grid, fit_clip
from oscar_export.calibration.config import CalibrationConfig
from oscar_export.calibration.pipeline import calibrate, fit_layer
from oscar_export.calibration.rotation import rotation
from oscar_export.kernels.layout import RowFormat

from helpers import PLANTED_SHAPE, ByteTokenizer, small_cfg, stats_and_objective

H_KV, _, D, T, P = PLANTED_SHAPE


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=96, vocab_size=256, head_dim=16, rope_theta=1000.0)
    return LlamaForCausalLM(cfg).eval()


def cfg(**kw) -> CalibrationConfig:
    base = dict(tokens=10 * T, seq_len=T, heldout=1, sink=0, window=0, page_size=P, key_granularity="token")
    base.update(kw)
    return CalibrationConfig(**base)


@pytest.mark.parametrize("kw", [{}, {"key_granularity": "token", "per_head": False, "codebook": "auto"},
                                {"rotation": "oscar", "clip": "global", "value_weighting": "research"}])
def test_calibrate_tiny_model(tiny, tmp_path, kw):
    cfg = small_cfg(**kw)
    seen = []
    art = calibrate(tiny, ByteTokenizer(256), cfg, on_layer=lambda i, s: seen.append(i))
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


def test_non_power_of_two_head_dim_falls_back(tmp_path):
    """head_dim 48: 'auto' drops the Hadamard kinds (documented fallback); a fixed Hadamard is a clear error."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=256, head_dim=48)
    model = LlamaForCausalLM(cfg).eval()
    art = calibrate(model, ByteTokenizer(256), small_cfg())
    s = art.stats["layers"][0]
    assert s["k"]["vs_hadamard"] is None and "hadamard+clip" not in s["k"]["baselines"]
    assert not any("hadamard" in c or "oscar" in c for c in s["k"]["rotation"] + s["v"]["rotation"])
    art.save(tmp_path)
    load_artifact(tmp_path, model.config)
    with pytest.raises(NotImplementedError, match="power of two, got 48"):
        calibrate(model, ByteTokenizer(256), small_cfg(rotation="hadamard"))


def test_device_map_with_hooks_gives_the_plain_artifact(tiny):
    """A model dispatched by accelerate (hooks on every layer, as ``--device-map`` loads it) calibrates to the same
    tensors as the plain model. On the CPU only: the multi-GPU run is benchmarks/calibrate_tp.py --small (untested)."""
    import copy

    accelerate = pytest.importorskip("accelerate")
    plain = calibrate(tiny, ByteTokenizer(256), small_cfg())
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    hooked = accelerate.dispatch_model(copy.deepcopy(tiny), device_map, main_device="cpu", force_hooks=True)
    assert all(hasattr(layer, "_hf_hook") for layer in hooked.model.layers)  # the collector passes through hooks
    mapped = calibrate(hooked, ByteTokenizer(256), small_cfg())
    a, b = plain.tensors(), mapped.tensors()
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:4]


def test_calibrate_gives_four_bit_keys_within_the_budget(tiny, tmp_path):
    base = small_cfg().layout(2, 16)
    one = (base.int2_bits_per_element() + base.with_key_bits(4).int2_bits_per_element()) / 2  # 1 of 2 layers
    art = calibrate(tiny, ByteTokenizer(256), small_cfg(key_bits_budget=one, key_bits_metric="top"))
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
    assert calibrate(tiny, ByteTokenizer(256), small_cfg()).key_bits == (2, 2)


def test_layers_fitted_side_by_side_give_the_artifact_of_one_at_a_time(tiny):
    """``fit_threads`` layers fitted (and their key widths measured) at once, each on one torch thread: the same
    transforms, key widths and held-out statistics as one layer at a time; torch's thread count restored."""
    base = small_cfg().layout(2, 16)
    cfg = small_cfg(key_bits_budget=(base.int2_bits_per_element() + base.with_key_bits(4).int2_bits_per_element()) / 2)
    threads = torch.get_num_threads()
    one, two = (calibrate(tiny, ByteTokenizer(256), cfg, fit_threads=n) for n in (1, 2))
    assert torch.get_num_threads() == threads
    assert one.key_bits == two.key_bits and len(one.key_bits) == 2
    for a, b in zip(one.transforms, two.transforms):
        for name in ("k_rotation", "v_rotation", "k_clip", "v_clip", "k_mean", "v_mean", "k_scale", "v_scale"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert one.stats["layers"] == two.stats["layers"] and one.stats["key_bits"] == two.stats["key_bits"]


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_calibrated_beats_identity_and_hadamard(granularity):
    st, obj = stats_and_objective()
    c = cfg(key_granularity=granularity)
    layout = c.layout(H_KV, D)
    k, v = fit_layer(0, st, obj, layout, c)
    # Reference points fitted the same way (fitted clips) with a fixed rotation.
    k_had, v_had = fit_layer(0, st, obj, layout, cfg(key_granularity=granularity, rotation="hadamard"))
    k_id, v_id = fit_layer(0, st, obj, layout, cfg(key_granularity=granularity, rotation="identity"))
    print(granularity, "K", k.error.tolist(), k_had.error.tolist(), k_id.error.tolist(), k.chosen)
    print(granularity, "V", v.error.tolist(), v_had.error.tolist(), v_id.error.tolist(), v.chosen)
    for fit, had, ident in ((k, k_had, k_id), (v, v_had, v_id)):
        assert bool((fit.error <= had.error).all()) and bool((fit.error <= ident.error).all())
        assert float(fit.error.sum()) < 0.9 * float(had.error.sum())
        assert float(fit.error.sum()) < 0.5 * float(ident.error.sum())
        assert float(fit.error.sum()) < 0.5 * float(fit.baselines["identity"].sum())


def test_per_head_beats_shared_when_heads_disagree():
    st, obj = stats_and_objective(disagree=True)
    layout = cfg().layout(H_KV, D)
    per = fit_layer(0, st, obj, layout, cfg(rotation="eig", scale="whiten"))
    shared = fit_layer(0, st, obj, layout, cfg(rotation="eig", scale="whiten", per_head=False))
    # Keys: the queries' subspace differs per head, so one basis cannot serve both.
    print(per[0].error.tolist(), shared[0].error.tolist())
    assert float(per[0].error.sum()) < 0.6 * float(shared[0].error.sum())
    auto_per = fit_layer(0, st, obj, layout, cfg())
    auto_shared = fit_layer(0, st, obj, layout, cfg(per_head=False))
    assert float(auto_per[0].error.sum()) < 0.6 * float(auto_shared[0].error.sum())
    # Sanity of the control: when the heads agree, sharing loses (almost) nothing.
    st2, obj2 = stats_and_objective(disagree=False)
    per2 = fit_layer(0, st2, obj2, layout, cfg(rotation="eig", scale="whiten"))
    sh2 = fit_layer(0, st2, obj2, layout, cfg(rotation="eig", scale="whiten", per_head=False))
    assert float(sh2[0].error.sum()) < 1.1 * float(per2[0].error.sum())


def test_value_clips_are_one_grid_step_milder_than_the_fit_and_their_error_is_measured_there():
    """``fit_side`` of values keeps the fitted rotation but moves each head's clip ``VALUE_CLIP_STEPS`` grid steps
    toward 1.0 and reports the held-out error at that clip; keys keep the fitted clip."""
    from oscar_export.calibration.clipping import VALUE_CLIP_STEPS, milder
    from oscar_export.calibration.pipeline import fit_side

    assert VALUE_CLIP_STEPS == 1
    st, obj = stats_and_objective()
    fmt = RowFormat(D, D)
    c = cfg(rotation="hadamard", value_mean=False, key_mean=False)
    lv = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(H_KV, 4)
    one, zero = torch.ones(H_KV, D, dtype=torch.float64), torch.zeros(H_KV, D, dtype=torch.float64)
    for side, target, err in (("v", st.value_target("prob"), obj.value_errors), ("k", st.key_target(), obj.key_errors)):
        fn = lambda r, s, mu, cs, lv, err=err: err(r, s, mu, cs, lv, fmt)  # noqa: E731
        got = fit_side(side, target, target, torch.zeros(H_KV, D), fn, None, fmt, D, c, seed=0)
        r = rotation("hadamard", target, D, 0)
        fit = fit_clip(lambda cs: fn(r, one, zero, cs, lv), H_KV, clip_grid(D))
        want = milder(fit.clip, clip_grid(D), 1) if side == "v" else fit.clip
        assert torch.equal(got.clip, want), (side, got.clip, fit.clip)
        assert torch.allclose(got.error, fn(r, one, zero, [want], lv)[0].double(), rtol=1e-12)
        assert side == "k" or not torch.equal(got.clip, fit.clip)  # the planted values' fit clips: some move
