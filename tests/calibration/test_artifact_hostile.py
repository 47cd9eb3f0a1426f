"""Hostile artifacts (issue 16): bounded work before any trust, strict JSON types, usable tensor ranges, no escape.

Each test builds a small valid artifact, edits one thing the way a stranger's file could, and checks that
``load_artifact`` refuses it with one :class:`ArtifactError` naming what was expected and what came, quickly
and without large allocations.
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from oscar_export.calibration.artifact import OscarArtifact, load_artifact, write_files
from oscar_export.calibration.artifact_format import LIMITS, META_FILE, TENSOR_FILE, ArtifactError
from oscar_export.calibration.fingerprint import model_fingerprint
from oscar_export.calibration.safe_json import printable
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform


def small_artifact(layers: int = 2) -> OscarArtifact:
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                      intermediate_size=64, vocab_size=50, head_dim=16)
    fp = model_fingerprint(cfg)
    layout = KVCacheLayout.default(2, 16, sink=4, window=16, page_size=16)
    ts = [LayerTransform.identity(2, 16, 0.9, 0.95) for _ in range(layers)]
    return OscarArtifact(layout, ts, fp, {"method": "test"}, {"layers": [None] * layers})


def written(tmp_path: Path, edit_meta=None, edit_tensors=None, art=None) -> Path:
    art = art or small_artifact()
    meta, tensors = art.metadata(""), art.tensors()
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    d = tmp_path / "art"
    write_files(d, meta, tensors)
    return d


def refused(path: Path, match: str, seconds: float = 1.0, max_bytes: int = 4 << 20) -> ArtifactError:
    """load_artifact(path) raises ArtifactError matching ``match`` within ``seconds`` and ``max_bytes`` traced."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ArtifactError, match=match) as e:
            load_artifact(path)
    finally:
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert dt < seconds, f"took {dt:.2f} s"
    assert peak < max_bytes, f"peak traced allocation {peak:,} bytes"
    return e.value


# ---- bounded work ------------------------------------------------------------------------------------------


def test_num_layers_10_to_the_12_fails_fast(tmp_path):
    def edit(m):
        m["num_layers"] = 10**12
        m["fingerprint"]["num_hidden_layers"] = 10**12
    refused(written(tmp_path, edit), f"num_layers: expected an int in \\[1, {LIMITS.max_layers}\\], got 1000000000000")


def test_huge_sparse_tensor_file_refused_before_reading(tmp_path):
    d = written(tmp_path)
    with open(d / TENSOR_FILE, "r+b") as f:
        f.truncate(20 << 30)  # sparse 20 GiB
    refused(d, "rotations.safetensors: expected at most [0-9,]+ bytes .* got 21,474,836,480 bytes", seconds=0.5)


def test_tensor_file_is_hashed_in_a_stream(tmp_path, monkeypatch):
    """Neither Path.read_bytes nor a whole-file read(): the checksum is computed chunk by chunk."""
    d = written(tmp_path)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read_bytes({self})"))
    load_artifact(d)


def test_safetensors_header_size_bounded(tmp_path):
    d = written(tmp_path)
    blob = bytearray((d / TENSOR_FILE).read_bytes())
    blob[:8] = (2**62).to_bytes(8, "little")  # claims a 4 EiB header
    (d / TENSOR_FILE).write_bytes(bytes(blob))
    meta = json.loads((d / META_FILE).read_text())
    import hashlib

    meta["tensor_sha256"] = hashlib.sha256(bytes(blob)).hexdigest()
    (d / META_FILE).write_text(json.dumps(meta))
    refused(d, "unreadable safetensors file \\(header of 4,611,686,018,427,387,904 bytes: expected at most")


def test_huge_oscar_json_refused_before_parsing(tmp_path):
    d = written(tmp_path)
    with open(d / META_FILE, "r+b") as f:
        f.truncate(1 << 30)
    refused(d, f"oscar.json: expected at most {LIMITS.max_meta_bytes:,} bytes, got 1,073,741,824")


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deep_nesting_refused(tmp_path, depth):
    d = written(tmp_path)
    text = (d / META_FILE).read_text()
    deep = "[" * depth + "]" * depth
    (d / META_FILE).write_text(text.replace('"config": {', f'"deep": {deep}, "config": {{', 1))
    refused(d, f"nested deeper than {LIMITS.max_json_depth}")


# ---- JSON types and bounds -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,value,match",
    [
        (("values_prerotated",), "false", "values_prerotated: expected true or false, got 'false'"),
        (("values_prerotated",), 0, "values_prerotated: expected true or false, got 0"),
        (("layout", "key", "codebook"), "no", "layout.key.codebook: expected true or false, got 'no'"),
        (("layout", "sink"), 64.5, "layout.sink: expected an int in \\[0, 16384\\], got 64.5"),
        (("layout", "sink"), 10**12, "layout.sink: expected an int in \\[0, 16384\\], got 1000000000000"),
        (("layout", "sink"), True, "layout.sink: expected an int in \\[0, 16384\\], got True"),
        (("layout", "window"), -1, "layout.window: expected an int in \\[0, 65536\\], got -1"),
        (("layout", "page_size"), 2**40, "layout.page_size: expected an int in \\[16, 1024\\], got 1099511627776"),
        (("layout", "num_kv_heads"), 3.0, "layout.num_kv_heads: expected an int in \\[1, 256\\], got 3.0"),
        (("layout", "head_dim"), "16", "layout.head_dim: expected an int in \\[16, 512\\], got '16'"),
        (("layout", "key", "bits"), 2.0, "layout.key.bits: expected an int in \\[2, 2\\], got 2.0"),
        (("layout", "key", "granularity"), ["token"], "layout.key.granularity: expected one of"),
        (("layout", "value"), [1, 2], "layout.value: expected a JSON object, got a list"),
        (("layout", "extra"), 1, "layout: unexpected keys \\['extra'\\]"),
        (("fingerprint", "num_hidden_layers"), 2.0, "fingerprint.num_hidden_layers: expected an int"),
        (("fingerprint", "vocab_size"), 1e300, "fingerprint.vocab_size: expected an int"),
        (("fingerprint", "model_type"), 7, "fingerprint.model_type: expected a string"),
        (("fingerprint", "rope"), "x", "fingerprint.rope: expected a JSON object or null, got a str"),
        (("fingerprint",), [], "fingerprint: expected a JSON object, got a list"),
        (("num_layers",), 2.0, "num_layers: expected an int in \\[1, 1024\\], got 2.0"),
        (("tensor_file",), "../../etc/passwd", "tensor_file: expected 'rotations.safetensors'"),
        (("config",), "x", "config: expected a JSON object, got a str"),
        (("stats",), [1], "stats: expected a JSON object, got a list"),
        (("format_version",), 1.0, "unsupported format_version 1.0"),
        (("format_version",), True, "unsupported format_version True"),
    ],
    ids=lambda x: str(x)[:24],
)
def test_json_types_and_bounds(tmp_path, path, value, match):
    def edit(m):
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    refused(written(tmp_path, edit), match)


@pytest.mark.parametrize("value", [12, "ABC", None, "0" * 63 + "g"])
def test_checksum_field_typed(tmp_path, value):
    d = written(tmp_path)
    meta = json.loads((d / META_FILE).read_text())  # write_files fills the checksum in: edit the file itself
    meta["tensor_sha256"] = value
    (d / META_FILE).write_text(json.dumps(meta))
    refused(d, "tensor_sha256: expected 64 hex digits, got")


def test_missing_layout_field_named(tmp_path):
    refused(written(tmp_path, lambda m: m["layout"]["key"].pop("group_size")),
            "layout.key: missing keys \\['group_size'\\]")


def test_overflowing_float_literal_refused(tmp_path):
    d = written(tmp_path)
    text = (d / META_FILE).read_text()
    (d / META_FILE).write_text(text.replace('"sink": 4', '"sink": 1e999', 1))
    refused(d, "not valid JSON .*1e999")


def test_heads_must_divide(tmp_path):
    refused(written(tmp_path, lambda m: m["fingerprint"].__setitem__("num_attention_heads", 3)),
            "fingerprint.num_attention_heads: expected a multiple of num_key_value_heads = 2, got 3")


# ---- tensor ranges -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("v_mean", 1e6, "layers.1.v_mean: max \\|value\\| 1e\\+06 exceeds the limit 16384"),
        ("k_mean", -3e4, "layers.1.k_mean: max \\|value\\| 3e\\+04 exceeds the limit 16384"),
        ("v_scale", 1e30, "layers.1.v_scale: values must lie in \\[0.000244, 4096\\], got max 1e\\+30"),
        ("k_scale", 1e-30, "layers.1.k_scale: values must lie in \\[0.000244, 4096\\], got min 1e-30"),
    ],
)
def test_unusable_tensor_ranges_refused(tmp_path, name, value, match):
    def edit(t):
        t[f"layers.1.{name}"][0, 3] = value
    err = refused(written(tmp_path, edit_tensors=edit), match)
    assert "fp16" in str(err)  # the message says why the limit exists


def test_extreme_but_usable_ranges_load(tmp_path):
    def edit(t):
        t["layers.0.k_scale"][:] = LIMITS.scale_max
        t["layers.0.v_scale"][:] = LIMITS.scale_min
        t["layers.0.v_mean"][:] = -LIMITS.mean_abs_max
    load_artifact(written(tmp_path, edit_tensors=edit))


def test_limits_keep_fp16_params_finite():
    """The stated derivation: a row within ``LIMITS.row_abs`` maps to stored values inside the fp16 range."""
    worst = LIMITS.row_abs * LIMITS.scale_max + LIMITS.mean_abs_max
    assert worst * 2 / 3 < LIMITS.fp16_max and worst < LIMITS.fp16_max  # |lo| and (hi - lo) / 3
    assert torch.isfinite(torch.tensor([worst, 2 * worst / 3], dtype=torch.float16)).all()


# ---- files -------------------------------------------------------------------------------------------------------


def test_symlink_out_of_the_artifact_refused(tmp_path):
    d = written(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(d / TENSOR_FILE, outside)
    (d / TENSOR_FILE).symlink_to(outside)
    refused(d, "rotations.safetensors: a symbolic link leaving the artifact directory")


def test_symlink_inside_the_artifact_allowed(tmp_path):
    d = written(tmp_path)
    os.replace(d / TENSOR_FILE, d / "real.safetensors")
    (d / TENSOR_FILE).symlink_to("real.safetensors")
    load_artifact(d)


def test_not_a_regular_file_refused(tmp_path):
    d = written(tmp_path)
    (d / TENSOR_FILE).unlink()
    os.mkfifo(d / TENSOR_FILE)  # reading a FIFO would block forever
    refused(d, "rotations.safetensors: expected a regular file")


def test_missing_file_is_both_artifact_error_and_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_artifact(tmp_path)
    assert isinstance(e.value, ArtifactError)


# ---- strings ---------------------------------------------------------------------------------------------------


def test_printable_escapes_terminal_controls():
    s = "ok\x1b[2J\x1b]0;pwned\x07\r\n\u202e\x9b"
    out = printable(s)
    assert out.isprintable() and "\x1b" not in out and "\\x1b[2J" in out and "\\u202e" in out
    assert printable("x" * 1000, limit=20) == "x" * 17 + "..."
    assert printable("plain text: ä") == "plain text: ä"


def test_error_messages_escape_strings_from_the_file(tmp_path):
    err = refused(written(tmp_path, lambda m: m.__setitem__("format", "\x1b[31mevil")), "expected format")
    assert "\x1b" not in str(err)


def test_save_dying_half_way_never_leaves_a_loadable_mix(tmp_path, monkeypatch):
    """Each file is replaced whole (temporary + fsync + rename), oscar.json last: a save killed before the last
    rename leaves the old oscar.json beside the new tensors, which its checksum refuses, and no partial file."""
    d = tmp_path / "art"
    small_artifact().save(d)
    real = os.replace

    def killed_before_meta(src, dst):
        if Path(dst).name == META_FILE:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_meta)
    other = small_artifact()
    other = OscarArtifact(other.layout, [LayerTransform.identity(2, 16, 0.5, 0.5)] * 2, other.fingerprint)
    with pytest.raises(KeyboardInterrupt):
        other.save(d)
    monkeypatch.undo()
    assert sorted(p.name for p in d.iterdir()) == [META_FILE, TENSOR_FILE]
    refused(d, "checksum mismatch")
