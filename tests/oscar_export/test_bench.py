"""``oscar_export.bench``'s random inputs on the CPU (the timing itself needs a GPU: tests/oscar_export/test_cli.py
checks that it says so): the calibrated-shape artifact the end-to-end benchmark and the GPU tests serve with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oscar_export.bench import env_line, random_artifact
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.plugins.hf import cache_kwargs, enable_oscar

from helpers import tiny_llama


def test_random_artifact_has_a_calibrated_models_shape():
    """Per KV head an orthogonal key rotation and scalings in [0.5, 2], channel keys, 4-bit keys in every other
    layer (what the default recipe picks: about half), the same numbers for the same seed."""
    model = SimpleNamespace(config=SimpleNamespace(num_key_value_heads=2, head_dim=64, num_hidden_layers=4))
    art = random_artifact(model)
    assert art.key_bits == (4, 2, 4, 2)
    assert art.layout.key.granularity == "channel" and art.layout.num_kv_heads == 2 and art.layout.head_dim == 64
    assert len(art.transforms) == 4
    for t in art.transforms:
        r = t.k_rotation
        assert r.shape == (2, 64, 64)
        torch.testing.assert_close(r @ r.transpose(1, 2), torch.eye(64).expand(2, 64, 64), atol=1e-5, rtol=0)
        assert 0.5 <= float(t.k_scale.min()) and float(t.k_scale.max()) <= 2.0 and t.values_prerotated
    assert not torch.equal(art.transforms[0].k_rotation, art.transforms[1].k_rotation)
    again, other = random_artifact(model), random_artifact(model, seed=1)
    assert all(torch.equal(a.k_rotation, b.k_rotation) for a, b in zip(art.transforms, again.transforms))
    assert not torch.equal(art.transforms[0].k_rotation, other.transforms[0].k_rotation)


@torch.no_grad()
def test_random_artifact_serves_through_enable_oscar():
    """``enable_oscar`` takes it as an artifact: each layer's cache gets its key width and rotated keys."""
    model = tiny_llama()
    art = random_artifact(model)
    with enable_oscar(model, art, backend="torch") as oscar:
        cache = oscar.make_cache(1, 40)
        assert [layer.layout.key.bits for layer in cache.layers] == [4, 2]
        assert not any(layer.flags.keys_identity for layer in cache.layers)
        out = model(torch.randint(1, 96, (1, 24)), **cache_kwargs(model, cache)).logits
    assert out.shape == (1, 24, 96) and torch.isfinite(out).all()


def test_random_artifact_takes_a_layout_and_key_bits():
    model = SimpleNamespace(config=SimpleNamespace(num_key_value_heads=2, head_dim=64, num_hidden_layers=3))
    lay = KVCacheLayout.default(2, 64, "channel", sink=16, window=64, page_size=64)
    art = random_artifact(model, layout=lay, key_bits=(2, 4, 2))
    assert art.layout is lay and art.key_bits == (2, 4, 2)
    with pytest.raises(ValueError, match=r"key_bits: expected 3 entries \(one per layer\), got 2"):
        random_artifact(model, key_bits=(2, 4))


def test_env_line_names_the_gpu_versions_and_commit(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    line = env_line("abc1234")
    assert line.startswith(f"NVIDIA H200 | torch {torch.__version__} | triton ") and line.endswith(" | git abc1234")
