"""The model-family table on tiny random-weight models of every family, built from each family's real config class.

For every family: the table reads the facts the transformers module really has; ``enable_oscar`` accepts it and,
inside the windows, generates exactly what ``DynamicCache`` does; calibrate -> export -> ``from_pretrained`` with
a plain cache reproduces the original logits. For every unsupported feature: one ``NotImplementedError`` naming
it, the same at ``enable_oscar``, ``calibrate``, ``export`` and ``build``. (The fingerprint's refusal of another
family or shape is in test_fingerprint.py, capture's reading of the table in test_capture.py; the tiny models of
every family are ``helpers.TINY_FAMILIES``.)
"""

from __future__ import annotations

import inspect
import json
import sys

import pytest
import torch
import transformers
from transformers import DynamicCache

from oscar_export.calibration.artifact import OscarArtifact, load_artifact, model_fingerprint
from oscar_export.calibration.config import CalibrationConfig
from oscar_export.calibration.families import FAMILIES, family_for
from oscar_export.calibration.pipeline import calibrate
from oscar_export.cli import main
from oscar_export.export import export_checkpoint, fold_value_transforms
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf import cache_kwargs, enable_oscar

from helpers import FAMILY_VOCAB, TINY_FAMILIES, ByteTokenizer, family_config, family_model, logits

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

KINDS = list(TINY_FAMILIES)
#: what the table must say about each tiny model (independent of the table: read off transformers' source).
EXPECTED = {  # kind: (family name, scaling, rotary_dim, qk_norm, qkv_bias, o_bias)
    "llama": ("Llama", 16**-0.5, 16, False, True, True),
    "llama3": ("Llama", 16**-0.5, 16, False, False, False),
    "mistral": ("Mistral", 16**-0.5, 16, False, False, False),
    "mixtral": ("Mixtral", 16**-0.5, 16, False, False, False),
    "qwen2": ("Qwen2", 16**-0.5, 16, False, True, False),
    "qwen3": ("Qwen3", 16**-0.5, 16, True, False, False),
    "qwen3_moe": ("Qwen3-MoE", 16**-0.5, 16, True, False, False),
    "glm4": ("GLM-4", 16**-0.5, 8, False, True, False),
    "glm4_moe": ("GLM-4-MoE", 16**-0.5, 8, True, True, False),
    "gemma3": ("Gemma 3", 64**-0.5, 256, True, False, False),
    "gemma3_sliding": ("Gemma 3", 64**-0.5, 256, True, False, False),
}


# ---- the table reads each model's own facts --------------------------------------------------------------------


def test_every_family_is_tested():
    assert {family_config(k).model_type for k in KINDS} == set(FAMILIES)


@pytest.mark.parametrize("kind", KINDS)
def test_table_reads_the_modules_facts(kind):
    """Compared with what transformers built: head_dim, scale, projections, biases, norms, RoPE pairing and width."""
    model = family_model(kind)
    f = family_for(model)
    name, scaling, rotary, qk_norm, qkv_bias, o_bias = EXPECTED[kind]
    assert (f.family.name, f.qk_norm, f.qkv_bias, f.o_bias, f.rotary_dim) == (name, qk_norm, qkv_bias, o_bias, rotary)
    assert f.scaling == pytest.approx(scaling, rel=1e-12)
    layers = model
    for part in f.family.fold.layers.split("."):
        layers = getattr(layers, part)
    assert len(layers) == f.num_layers == TINY_FAMILIES[kind][2].get("num_hidden_layers", 2)
    for i, layer in enumerate(layers):
        attn = getattr(layer, f.family.fold.attention)
        assert (i in f.sliding_layers) == bool(getattr(attn, "sliding_window", None)), f"layer {i}"
        assert f.sliding_window == (8 if f.sliding_layers else None)
        assert attn.head_dim == f.head_dim and attn.scaling == pytest.approx(f.scaling, rel=1e-12)
        assert attn.q_proj.out_features == f.num_heads * f.head_dim
        assert getattr(attn, f.family.fold.v_proj).out_features == f.num_kv_heads * f.head_dim
        assert getattr(attn, f.family.fold.o_proj).in_features == f.num_heads * f.head_dim
        assert (attn.q_proj.bias is not None, attn.v_proj.bias is not None) == (f.qkv_bias, f.qkv_bias)
        assert (attn.o_proj.bias is not None) == f.o_bias
        assert (getattr(attn, "q_norm", None) is not None) == (getattr(attn, "k_norm", None) is not None) == f.qk_norm
    assert f.rope == model_fingerprint(model)["rope"]
    assert rope_pairing(model) == (1 if f.family.rope_interleaved else f.rotary_dim // 2, f.rotary_dim)


def rope_pairing(model) -> tuple[int, int]:
    """The model's own RoPE on one-hot keys at position 3: ``(the coordinate 0 rotates into, how many rotate)``."""
    attn = model.model.layers[0].self_attn
    apply = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    d = attn.head_dim
    rotary = model.model.rotary_emb
    kw = {"layer_type": "full_attention"} if "layer_type" in inspect.signature(rotary.forward).parameters else {}
    cos, sin = rotary(torch.zeros(1, 1, 1, d), torch.tensor([[3]]), **kw)
    partner, rotated = None, 0
    for i in range(d):
        e = torch.zeros(1, 1, 1, d)
        e[..., i] = 1.0
        _, k = apply(e, e, cos, sin)
        moved = (k - e).abs().flatten().gt(1e-6).nonzero().flatten().tolist()
        rotated += bool(moved)
        if i == 0:
            partner = next(j for j in moved if j != 0)
    return partner, rotated


def test_llama3_rope_and_gemma_head_dim_read_from_config():
    assert family_for(family_config("llama3")).rope["rope_type"] == "llama3"
    real_gemma = transformers.Gemma3TextConfig(layer_types=["full_attention"] * 26)  # the class defaults: 1B-like
    f = family_for(real_gemma)
    assert (f.head_dim, f.scaling, f.num_kv_heads) == (256, 256**-0.5, 4)


def test_config_dict_gets_its_class_defaults():
    """A config.json without a value the class defaults (here Gemma 3's head_dim 256): ``family_for_config_dict``
    reads it back from the config class, not from a hidden_size // heads rule."""
    from oscar_export.calibration.families import family_for_config_dict

    d = {k: v for k, v in family_config("gemma3_sliding").to_dict().items() if k != "head_dim"}
    f = family_for_config_dict(d)
    assert (f.head_dim, f.scaling, f.sliding_layers, f.num_layers) == (256, 64**-0.5, (0, 2), 3)
    with pytest.raises(NotImplementedError, match=r"architecture 'GPT2LMHeadModel' \(model_type 'gpt2'\) is not"):
        family_for_config_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


# ---- refusals: one NotImplementedError naming the feature ---------------------------------------------------------


def unsupported_configs():
    sliding = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    return {
        "mistral-sliding": (family_config("mistral", sliding_window=8), r"sliding-window attention in 2 of 2 layers"),
        "mistral-default": (transformers.MistralConfig(), r"sliding-window attention in 32 of 32 layers .*4096"),
        "mixtral-sliding": (family_config("mixtral", sliding_window=8), r"sliding-window attention in 2 of 2"),
        "qwen2-sliding": (family_config("qwen2", **sliding), r"sliding-window attention in 1 of 2 layers \(1;"),
        "qwen3-sliding": (family_config("qwen3", **sliding), r"sliding-window attention in 1 of 2 layers \(1;"),
        "qwen3_moe-sliding": (family_config("qwen3_moe", use_sliding_window=True, sliding_window=8),
                              r"sliding-window attention in 2 of 2"),
        "gemma3-all-sliding": (family_config("gemma3", layer_types=None),  # 2 layers of the 5:1 pattern: both slide
                               r"sliding-window attention in every layer \(sliding_window=4096\); the OSCAR cache "
                               r"keeps the global layers, and there are none"),
        "gemma3-softcap": (family_config("gemma3", attn_logit_softcapping=30.0),
                           r"soft-capping \(attn_logit_softcapping=30.0\)"),
        "gemma2": (transformers.Gemma2Config(),
                   r"'Gemma2Config' \(model_type 'gemma2'\) uses attention logit soft-capping"),
        "gpt2": (transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50),
                 r"architecture 'GPT2Config' \(model_type 'gpt2'\) is not supported; supported model types: llama"),
        "deepseek-mla": (transformers.DeepseekV3Config(), r"multi-head latent attention \(MLA, kv_lora_rank=512\)"),
        "qwen2-layer-types": (family_config("qwen2", layer_types=["full_attention", "chunked_attention"]),
                              r"layer types \['chunked_attention'\]"),
    }


@pytest.mark.parametrize("name", list(unsupported_configs()))
def test_unsupported_features_are_named(name):
    cfg, msg = unsupported_configs()[name]
    with pytest.raises(NotImplementedError, match=msg):
        family_for(cfg)


def test_unknown_rope_type_is_named():
    cfg = family_config("llama")
    cfg.rope_parameters = {"rope_type": "mrope", "rope_theta": 1e4}
    with pytest.raises(NotImplementedError, match=r"RoPE type 'mrope'; supported RoPE types: default, linear"):
        family_for(cfg)
    with pytest.raises(NotImplementedError, match="bidirectional attention"):
        family_for(family_config("gemma3", use_bidirectional_attention=True))


def test_qwen2_sliding_flag_without_sliding_layers_is_full_attention():
    """use_sliding_window with max_window_layers >= L slides no layer (layer_types say so; Qwen2 follows them):
    accepted, and served exactly like DynamicCache."""
    f = family_for(family_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert f.sliding_layers == () and f.sliding_window is None
    model = family_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    ids = torch.randint(1, FAMILY_VOCAB, (1, 20))  # longer than the window that no layer uses
    want = generate(model, ids, DynamicCache(config=model.config))
    with enable_oscar(model) as oscar:
        got = generate(model, ids, oscar.make_cache(1, 64))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


# ---- enable_oscar: accepted, and inside the windows identical to DynamicCache ----------------------------------


def generate(model, ids, cache, n=12):
    out = model.generate(ids, max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, **({} if cache is None else cache_kwargs(model, cache)))
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_oscar_generation_equals_dynamic_cache_inside_windows(kind):
    """Greedy tokens identical, scores equal to fp32 noise. Gemma 3 also checks the scale: its
    query_pre_attn_scalar (64) is not head_dim (256), and a hard-coded D ** -0.5 changes its tokens."""
    model = family_model(kind)
    ids = torch.randint(1, FAMILY_VOCAB, (1, 20))
    want_tokens, want_scores = generate(model, ids, DynamicCache(config=model.config))
    with enable_oscar(model) as oscar:
        assert (oscar.shape.num_kv_heads, oscar.shape.head_dim) == (2, TINY_FAMILIES[kind][2].get("head_dim", 16))
        cache = oscar.make_cache(1, 64)
        tokens, scores = generate(model, ids, cache)
    assert cache.sequence_lengths() == [20 + 12 - 1]  # every step went through the OSCAR cache
    if not torch.equal(tokens, want_tokens):
        raise AssertionError(f"{kind}: tokens differ first at step {(tokens != want_tokens).nonzero()[0].tolist()}")
    torch.testing.assert_close(scores, want_scores, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "glm4", "glm4_moe", "gemma3"])
def test_beyond_windows_runs_through_int2_pages(kind):
    """Mechanics past the windows (MoE, GLM's interleaved partial RoPE, Gemma's 2 groups per 256-wide row): 30
    tokens through INT2 pages, finite scores, one page per 16 demoted tokens in every layer."""
    model = family_model(kind)
    d = family_for(model).head_dim
    layout = KVCacheLayout.default(2, d, "channel", sink=4, window=16, page_size=16)
    with enable_oscar(model, layout=layout) as oscar:
        cache = oscar.make_cache(1, 120)
        tokens, scores = generate(model, torch.randint(1, FAMILY_VOCAB, (1, 50)), cache, n=30)
    n = 50 + 30 - 1
    assert tokens.shape == (1, 30) and bool(torch.isfinite(scores).all())
    assert [int(layer.state.num_pages[0]) for layer in cache.layers] == [layout.pages_for(n)] * 2 == [3, 3]
    assert cache.kv_bytes() == 2 * layout.sequence_bytes(n)


# ---- calibrate -> export -> from_pretrained ---------------------------------------------------------------------


def family_cfg(**kw) -> CalibrationConfig:
    """A ``CalibrationConfig`` for the tiny family models: 6 sequences of 48 tokens (2 held out), sink 16, window 16
    (smaller than ``helpers.small_cfg``, which is sized for ``capture_llama``)."""
    base = dict(tokens=6 * 48, seq_len=48, heldout=2, batch_size=4, sink=16, window=16, page_size=16)
    return CalibrationConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", KINDS)
def test_calibrate_export_reload_reproduces_logits(kind, tmp_path):
    model = family_model(kind)
    ids = torch.randint(0, FAMILY_VOCAB, (2, 13))
    ref = logits(model, ids)
    art = calibrate(model, ByteTokenizer(), family_cfg(rotation="random", scale="whiten"))
    assert art.fingerprint["model_type"] == model.config.model_type
    v_before = model.model.layers[1].self_attn.v_proj.weight.clone()
    out = export_checkpoint(model, None, art, tmp_path / "ckpt")
    assert not torch.equal(v_before, model.model.layers[1].self_attn.v_proj.weight)  # the fold really ran
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded).__name__ == TINY_FAMILIES[kind][1]
    diff = (logits(loaded, ids) - ref).abs().max().item()
    assert diff < 1e-4, f"{kind}: max |logit diff| {diff:.3g} after export (logit scale {ref.abs().max().item():.3g})"
    load_artifact(out / "oscar_artifact", loaded.config)  # the bundled artifact matches the exported model


# ---- the fingerprint refuses another family or shape -------------------------------------------------------------


# ---- capture: the scale and head counts come from the table ---------------------------------------------------


# ---- every stage refuses with enable_oscar's message --------------------------------------------------------------


def test_every_stage_refuses_sliding_windows_with_one_message(tmp_path, capsys):
    """enable_oscar, calibrate, export (Python and CLI) and build give the same line, before loading weights."""
    model = family_model("mistral", sliding_window=8)
    with pytest.raises(NotImplementedError) as e:
        enable_oscar(model)
    msg = str(e.value)
    assert msg.startswith("OSCAR: architecture 'MistralForCausalLM' (model_type 'mistral') has sliding-window")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(NotImplementedError) as e:
        calibrate(model, ByteTokenizer(), family_cfg())
    assert str(e.value) == msg
    with pytest.raises(NotImplementedError) as e:
        fold_value_transforms(model, [LayerTransform.identity(2, 16)] * 2)
    assert str(e.value) == msg
    (tmp_path / "model").mkdir()
    model.config.save_pretrained(tmp_path / "model")  # config only: the weights must never be needed
    (tmp_path / "art").mkdir()
    for argv in (["calibrate", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "a")],
                 ["export", "--model", str(tmp_path / "model"), "--artifact", str(tmp_path / "art"),
                  "--out", str(tmp_path / "o")]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"oscar-export {argv[0]}: error: {msg}\n"
    # build: an export of the full-attention model whose config.json was then given a sliding window
    full = family_model("mistral")
    ckpt = export_checkpoint(full, None, OscarArtifact.identity(full), tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "sliding_window": 8}))
    capsys.readouterr()  # the checkpoint writer's progress bar
    assert main(["build", "--export", str(ckpt), "--out", str(tmp_path / "deploy")]) == 2
    assert capsys.readouterr().err == f"oscar-export build: error: {msg}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "ckpt", "model"]


def test_every_stage_refuses_an_unknown_architecture(tmp_path, capsys):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50,
                                                                architectures=["GPT2LMHeadModel"]))
    with pytest.raises(NotImplementedError) as e:
        enable_oscar(gpt2)
    msg = str(e.value)
    assert "architecture 'GPT2LMHeadModel' (model_type 'gpt2') is not supported" in msg
    gpt2.config.save_pretrained(tmp_path / "model")
    assert main(["calibrate", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == f"oscar-export calibrate: error: {msg}\n"
    with pytest.raises(NotImplementedError) as e:
        calibrate(gpt2, ByteTokenizer(), family_cfg())
    assert str(e.value) == msg
