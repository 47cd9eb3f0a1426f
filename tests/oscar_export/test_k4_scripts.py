"""The issue-17 benchmark scripts' CPU parts: ``bench_e2e``'s mixed-key-width bookkeeping (bytes, key bits per
cache kind) and ``artifact_key_bits`` (a diagnosis-chosen layer set written as calibration writes one)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark_script

from oscar_export.calibration.artifact import OscarArtifact, load_artifact
from oscar_export.kernels.layout import KVCacheLayout


def test_e2e_mixed_caches_count_each_layers_bytes():
    """``bench_e2e``'s artifact has 4-bit keys in every other layer (what the default recipe picks: about half) and
    its byte count (the roofline's cache bytes) counts each layer at its own key width."""
    from types import SimpleNamespace

    e2e = load_benchmark_script("bench_e2e")
    model = SimpleNamespace(config=SimpleNamespace(num_key_value_heads=2, head_dim=64, num_hidden_layers=4))
    art = e2e.random_artifact(model)
    assert art.key_bits == (4, 2, 4, 2)
    lay = KVCacheLayout.default(8, 128, "channel")
    got = e2e.oscar_sequence_bytes(lay, (4, 4, 2, 2), 32768)
    assert got == 2 * lay.with_key_bits(4).sequence_bytes(32768) + 2 * lay.sequence_bytes(32768)
    assert lay.sequence_bytes(32768) < lay.with_key_bits(4).sequence_bytes(32768)


def test_artifact_key_bits_widens_the_named_layers_only(tmp_path):
    from transformers import LlamaConfig

    script = load_benchmark_script("artifact_key_bits")
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, head_dim=16,
                      vocab_size=10)
    src = OscarArtifact.identity(cfg, k_clip=0.9)
    src.save(tmp_path / "src")
    assert script.main([str(tmp_path / "src"), str(tmp_path / "out"), "--k4", "1-2"]) == 0
    out = load_artifact(tmp_path / "out")
    assert out.key_bits == (2, 4, 4, 2) and out.config["key_bits_layers"] == "1-2"
    assert [float(t.k_clip.max()) for t in out.transforms] == pytest.approx([0.9, 1.0, 1.0, 0.9])
    assert all(torch.equal(a.k_rotation, b.k_rotation) for a, b in zip(out.transforms, src.transforms))
    with pytest.raises(SystemExit, match="already has mixed key bits"):
        script.main([str(tmp_path / "out"), str(tmp_path / "again"), "--k4", "0"])
    with pytest.raises(SystemExit, match=r"--k4: layers \[7\] not in 0..3"):
        script.main([str(tmp_path / "src"), str(tmp_path / "bad"), "--k4", "7"])
