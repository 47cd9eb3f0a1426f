"""``calibration/fingerprint.py``: what an artifact records of its model, and the mismatches it refuses."""

from __future__ import annotations

import pytest

from oscar_export.calibration.artifact import OscarArtifact, load_artifact
from oscar_export.calibration.fingerprint import model_fingerprint
from oscar_export.export import export_checkpoint
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.plugins.hf import enable_oscar

from helpers import artifact_config, config_artifact, family_model, refused, written


def test_fingerprint_of_smollm2_like_config():
    fp = model_fingerprint(artifact_config(rope_theta=1e5))
    assert fp["num_hidden_layers"] == 3 and fp["num_key_value_heads"] == 2 and fp["head_dim"] == 16
    assert fp["rope"]["rope_theta"] == 1e5


def test_wrong_layer_count_for_model(tmp_path):
    config_artifact().save(tmp_path)
    with pytest.raises(ValueError, match="num_hidden_layers: artifact 3, model 4"):
        load_artifact(tmp_path, artifact_config(num_hidden_layers=4))


def test_renamed_from_another_model(tmp_path):
    """Same shapes, different RoPE and heads: the fingerprint names both."""
    config_artifact(artifact_config(rope_theta=1e4)).save(tmp_path)
    other = artifact_config(rope_theta=1e5)
    with pytest.raises(ValueError, match="rope: artifact"):
        load_artifact(tmp_path, other)
    with pytest.raises(ValueError, match="num_attention_heads: artifact 4, model 2"):
        load_artifact(tmp_path).check_model(artifact_config(num_attention_heads=2, hidden_size=32, rope_theta=1e4))
    load_artifact(tmp_path).check_model(artifact_config(rope_theta=1e4))  # the right model passes


def test_heads_must_divide(tmp_path):
    refused(written(tmp_path, lambda m: m["fingerprint"].__setitem__("num_attention_heads", 3)),
            "fingerprint.num_attention_heads: expected a multiple of num_key_value_heads = 2, got 3")


def test_fingerprint_refuses_another_family_or_shape(tmp_path):
    llama = family_model("llama")
    art = OscarArtifact.identity(llama, KVCacheLayout.default(2, 16, sink=4, window=16, page_size=16))
    art.save(tmp_path / "art")
    mistral = family_model("mistral")  # same shape, another family
    with pytest.raises(ValueError, match=r"^OSCAR artifact does not match this model .*model_type: artifact 'llama', "
                                         r"model 'mistral'$"):
        enable_oscar(mistral, artifact=tmp_path / "art")
    wide = family_model("llama", num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"num_key_value_heads: artifact 2, model 4"):
        load_artifact(tmp_path / "art", wide.config)
    with pytest.raises(ValueError, match=r"model_type: artifact 'llama', model 'qwen3'; num_hidden_layers: "
                                         r"artifact 2, model 3"):
        export_checkpoint(family_model("qwen3", num_hidden_layers=3), None, art, tmp_path / "ckpt")
    gemma = family_model("gemma3")
    scaled = family_model("gemma3", query_pre_attn_scalar=128)  # same shape, another attention scale
    with pytest.raises(ValueError, match=r"attention_scaling: artifact 0.125, model 0.0883"):
        OscarArtifact.identity(gemma).check_model(scaled)
    assert not (tmp_path / "ckpt").exists()


def test_fingerprint_of_an_older_artifact_without_the_scale_still_matches():
    llama = family_model("llama")
    art = OscarArtifact.identity(llama)
    fp = {k: v for k, v in art.fingerprint.items() if k != "attention_scaling"}
    OscarArtifact(art.layout, art.transforms, fp).check_model(llama)
