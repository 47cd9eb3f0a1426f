"""``benchmarks/calibrate_tp.py --tiny --device cpu``: the empty-weights build on two "devices" (accelerate hooks on
every layer), the device-mapped calibration, and the one-device vs split comparison, at toy size on the CPU.
The GPU modes of the script are untested (no multi-GPU machine)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers import load_benchmark_script

pytest.importorskip("accelerate")


def _script():
    return load_benchmark_script("calibrate_tp")


def test_tiny_cpu_smoke_mode_runs_both_flows(tmp_path):
    bench = _script()
    out = tmp_path / "tp.json"
    assert bench.main(["--tiny", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "tiny" and res["devices"] == ["cpu", "cpu"] and res["dtype"] == "float32"
    big = res["build_and_calibrate"]
    layers = res["shape"]["layers"]
    assert big["num_layers_calibrated"] == layers and big["layers_per_device"] == {"cpu": layers}
    assert big["weights_bytes_per_device"]["cpu"] > 0 and big["peak_bytes_per_gpu"] == {}  # no CUDA here
    cmp = res["one_vs_all"]
    assert cmp["tensors_compared"] == 10 * layers and cmp["tensors_outside_rtol"] == []


def test_device_map_splits_layers_evenly():
    bench = _script()
    dm = bench.split_layers(5, ["cuda:0", "cuda:1"])
    assert [dm[f"model.layers.{i}"] for i in range(5)] == ["cuda:0"] * 3 + ["cuda:1"] * 2
    assert dm["model.embed_tokens"] == "cuda:0" and dm["lm_head"] == "cuda:1"
    assert bench.device_of(dm, "model.layers.3.self_attn.q_proj.weight") == "cuda:1"
    assert bench.device_of({"": 0}, "model.norm.weight") == "cuda:0"


def test_compare_reports_a_difference():
    """The comparison can fail: one rotation perturbed beyond 1e-6 relative is reported, naming the tensor."""
    from transformers import LlamaConfig

    from oscar_export.calibration.artifact import OscarArtifact

    bench = _script()
    art = OscarArtifact.identity(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             num_hidden_layers=2, head_dim=16, vocab_size=10))
    t = art.transforms[1]
    c, s = torch.cos(torch.tensor(1e-5)), torch.sin(torch.tensor(1e-5))
    r = t.v_rotation.clone()
    r[0, :2, :2] = torch.stack([torch.stack([c, -s]), torch.stack([s, c])])  # still orthogonal, 1e-5 away
    other = replace(art, transforms=(art.transforms[0], replace(t, v_rotation=r)))
    bad = [row for row in bench.compare(art, other) if not row["ok"]]
    assert [row["tensor"] for row in bad] == ["layers.1.v_rotation"] and bad[0]["rel"] > 1e-6


def test_cpu_runs_tiny_only(tmp_path, capsys):
    assert _script().main(["--device", "cpu", "--out", str(tmp_path / "x.json")]) == 2
    assert "--device cpu runs --tiny only" in capsys.readouterr().err
