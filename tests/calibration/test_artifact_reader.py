"""``calibration/artifact_reader.py``: an artifact's two files read as hostile input. Bounded work before any trust
(file sizes, counts, the tensor file hashed as it streams, the safetensors header's length), files that are
links, FIFOs or cannot be opened, and a fuzz of the whole loader.

The fuzz: a fixed seed, a fixed number of mutated artifacts, each ends well. Every case is a small valid artifact
with one random mutation: byte flips in ``oscar.json`` or in the tensor
file (with and without a matching checksum), a deleted field, a swapped type, a huge or odd number, deep
nesting, an extreme tensor value. Each must end in exactly one of two ways:

* :class:`ArtifactError` (a ``ValueError``), or
* a correct load: the artifact returned says what the file says (layout, layer count, flags) and passes
  :func:`validate`.

No other exception, no case over ``CASE_SECONDS``, and no case whose peak Python allocation (``tracemalloc``,
which sees JSON parsing, the file buffer and every list or set built from the metadata; torch's own
allocator is not traced, but every tensor is built from that file buffer) exceeds ``PEAK_BYTES``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from oscar_export.calibration.artifact import OscarArtifact, load_artifact, write_files
from oscar_export.calibration.artifact_checks import validate
from oscar_export.calibration.artifact_format import LIMITS, META_FILE, TENSOR_FILE, ArtifactError, ArtifactMissing
from oscar_export.calibration.fingerprint import model_fingerprint
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

from helpers import config_artifact, refused, tamper, written

SEED = 16
CASES = 200
CASE_SECONDS = 1.0
#: the valid artifact's tensor file is ~9 KB; 2 MiB leaves room for parsing but not for a size taken from the file.
PEAK_BYTES = 2 << 20

HUGE = [10**12, 2**63, -(2**63), 10**400, 1e308, -1e308, 5e-324, -1, 0, 64.5, 3.0, 2**31]
SWAPS = ["false", "true", "3", "", None, True, False, 0, 1.5, [], {}, [1, 2], {"a": 1}, "\x1b[31m"]


def base_artifact() -> OscarArtifact:
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=64, vocab_size=50, head_dim=16)
    fp = model_fingerprint(cfg)
    layout = KVCacheLayout.default(2, 16, sink=4, window=16, page_size=16)
    g = torch.Generator().manual_seed(0)
    ts = []
    for _ in range(2):
        q = torch.linalg.qr(torch.randn(2, 16, 16, generator=g, dtype=torch.float64))[0].float()
        t = LayerTransform.identity(2, 16, 0.9, 0.95)
        ts.append(replace(t, k_rotation=q, v_mean=torch.randn(2, 16, generator=g)))
    return OscarArtifact(layout, ts, fp, {"method": "fuzz", "seed": 0}, {"layers": [{"k": {}, "v": {}}] * 2})


def _paths(node, prefix=()):
    """Every (path) to a dict entry or list item in a JSON tree."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


def _parent(meta, path):
    node = meta
    for k in path[:-1]:
        node = node[k]
    return node


def mutate(rng: random.Random, d: Path, meta: dict, tensors: dict) -> str:
    """Apply one random mutation to the artifact files in ``d``; returns a description (for failure messages)."""
    kind = rng.choice(["meta-bytes", "tensor-bytes", "tensor-bytes-resigned", "delete", "swap", "huge", "nest",
                       "tensor-value", "truncate"])
    meta = copy.deepcopy(meta)
    paths = list(_paths(meta))
    if kind in ("delete", "swap", "huge", "nest"):
        path = rng.choice(paths)
        parent = _parent(meta, path)
        if kind == "delete":
            if isinstance(parent, list):
                parent.pop(path[-1])
            else:
                del parent[path[-1]]
        elif kind == "swap":
            parent[path[-1]] = rng.choice(SWAPS)
        elif kind == "huge":
            parent[path[-1]] = rng.choice(HUGE)
        else:
            depth = rng.choice([5, 33, 200, 5000])
            parent[path[-1]] = json.loads("[" * depth + "]" * depth) if depth < 900 else "@@NEST@@"
            if depth >= 900:  # too deep for json.dumps: write the text by hand below
                path_desc = f"{kind} {path} depth {depth}"
                write_files(d, meta, tensors)
                text = (d / META_FILE).read_text().replace('"@@NEST@@"', "[" * depth + "]" * depth)
                (d / META_FILE).write_text(text)
                return path_desc
        write_files(d, meta, tensors)
        return f"{kind} {path}"
    if kind == "tensor-value":
        name = rng.choice(sorted(tensors))
        t = tensors[name].clone()
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([1e30, -1e30, 1e-30, 1e6, -1.0, 0.0, 3.5, 1e-8])
        write_files(d, meta, {**tensors, name: t})
        return f"{kind} {name}"
    write_files(d, meta, tensors)
    if kind == "meta-bytes":
        f = d / META_FILE
    else:
        f = d / TENSOR_FILE
    blob = bytearray(f.read_bytes())
    if kind == "truncate":
        cut = rng.randrange(len(blob))
        blob = blob[:cut]
        where = f"at {cut}"
    else:
        n = rng.choice([1, 1, 2, 8])
        pos = [rng.randrange(len(blob)) if rng.random() < 0.5 else rng.randrange(min(len(blob), 300))
               for _ in range(n)]  # half of the flips in the header
        for p in pos:
            blob[p] ^= 1 << rng.randrange(8)
        where = f"bits at {pos}"
    f.write_bytes(bytes(blob))
    if kind in ("tensor-bytes-resigned", "truncate") and f.name == TENSOR_FILE and rng.random() < 0.7:
        m = json.loads((d / META_FILE).read_text())  # a hand-edited oscar.json that matches the tampered file
        m["tensor_sha256"] = hashlib.sha256(bytes(blob)).hexdigest()
        (d / META_FILE).write_text(json.dumps(m))
    return f"{kind} {f.name} {where}"


def check_correct_load(art: OscarArtifact, d: Path) -> None:
    meta = json.loads((d / META_FILE).read_text())
    assert art.layout == KVCacheLayout.from_dict(meta["layout"])  # a dict without "packing" means linear
    assert art.num_layers == meta["num_layers"] == art.fingerprint["num_hidden_layers"]
    assert all(t.values_prerotated is meta["values_prerotated"] for t in art.transforms)
    assert art.config == meta.get("config", {}) and art.stats == meta.get("stats", {})
    validate(art)


def test_fuzz_artifacts(tmp_path):
    base = base_artifact()
    meta, tensors = base.metadata(""), base.tensors()
    rng = random.Random(SEED)
    outcomes = {"error": 0, "load": 0}
    t_all = time.perf_counter()
    for i in range(CASES):
        d = tmp_path / f"case{i}"
        what = mutate(rng, d, meta, tensors)
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            art = load_artifact(d)
        except ArtifactError as e:
            outcomes["error"] += 1
            assert str(e) and "\n" not in str(e), f"case {i} ({what}): message {e!r}"
            art = None
        except Exception as e:  # noqa: BLE001 - the point of the test
            raise AssertionError(f"case {i} ({what}): {type(e).__name__}: {e}") from e
        finally:
            dt = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert dt < CASE_SECONDS, f"case {i} ({what}): {dt:.2f} s"
        assert peak < PEAK_BYTES, f"case {i} ({what}): peak {peak:,} bytes traced"
        if art is not None:
            outcomes["load"] += 1
            check_correct_load(art, d)
    print(f"{CASES} cases: {outcomes} in {time.perf_counter() - t_all:.1f} s")
    # The mutations must exercise both outcomes (a loader that refused everything would also pass otherwise).
    assert outcomes["error"] > CASES // 2 and outcomes["load"] >= 5, outcomes


def test_unmutated_base_loads(tmp_path):
    base = base_artifact()
    base.save(tmp_path)
    check_correct_load(load_artifact(tmp_path), tmp_path)


def test_missing_files_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="oscar.json is missing"):
        load_artifact(tmp_path)
    config_artifact().save(tmp_path)
    (tmp_path / TENSOR_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="rotations.safetensors is missing"):
        load_artifact(tmp_path)
    (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_artifact(tmp_path)


def test_wrong_layer_count_in_files(tmp_path):
    def drop_layer(t):
        for k in [k for k in t if k.startswith("layers.2.")]:
            del t[k]
    with pytest.raises(ValueError, match="tensor names do not match 3 layers: missing \\['layers.2"):
        load_artifact(tamper(tmp_path, drop_layer))


def test_truncated_safetensors_refused(tmp_path):
    config_artifact().save(tmp_path)
    f = tmp_path / TENSOR_FILE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match="checksum mismatch \\(file truncated or modified\\)"):
        load_artifact(tmp_path)
    # Even with a matching checksum (a hand-edited oscar.json), the truncated file is refused by the parser.
    import hashlib
    meta = json.loads((tmp_path / META_FILE).read_text())
    meta["tensor_sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unreadable safetensors file"):
        load_artifact(tmp_path)


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


@pytest.mark.parametrize("value", [12, "ABC", None, "0" * 63 + "g"])
def test_checksum_field_typed(tmp_path, value):
    d = written(tmp_path)
    meta = json.loads((d / META_FILE).read_text())  # write_files fills the checksum in: edit the file itself
    meta["tensor_sha256"] = value
    (d / META_FILE).write_text(json.dumps(meta))
    refused(d, "tensor_sha256: expected 64 hex digits, got")


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


def test_a_path_that_cannot_be_opened_is_not_called_missing(tmp_path):
    """An unreadable artifact folder or a too-long path is reported as what it is, not as "oscar.json is missing"."""
    with pytest.raises(ArtifactError, match="cannot be opened: File name too long"):
        load_artifact(tmp_path / ("x" * 300))
    with pytest.raises(ArtifactError, match="cannot be opened: Not a directory"):
        (tmp_path / "file").write_text("x")
        load_artifact(tmp_path / "file")
    with pytest.raises(ArtifactMissing, match="oscar.json is missing"):
        load_artifact(tmp_path / "nothing-here")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a folder without read permission")
def test_an_unreadable_folder_is_not_called_missing(art_dir):
    art_dir.chmod(0)
    try:
        with pytest.raises(ArtifactError, match="cannot be opened: Permission denied"):
            load_artifact(art_dir)
    finally:
        art_dir.chmod(0o755)


FLIP = """
import os, sys
from pathlib import Path
d, outside = Path(sys.argv[1]), sys.argv[2]
n = 0
while True:
    tmp = d / f".flip{n % 2}"
    os.symlink(outside if n % 2 else "inside.json", tmp)
    os.replace(tmp, d / "oscar.json")
    n += 1
"""


def test_a_link_flipped_during_loads_is_never_read_from_outside(art_dir, tmp_path):
    """A symlink flipped between an inside and an outside file while loads run is never read from outside."""
    meta = json.loads((art_dir / "oscar.json").read_text())
    inside = art_dir / "inside.json"
    inside.write_text(json.dumps({**meta, "config": {"where": "inside"}}))
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({**meta, "config": {"where": "outside"}}))
    (art_dir / "oscar.json").unlink()
    (art_dir / "oscar.json").symlink_to("inside.json")
    flipper = subprocess.Popen([sys.executable, "-c", FLIP, str(art_dir), str(outside)])  # truly in parallel
    seen = {"inside": 0, "refused": 0}
    try:
        # On a loaded machine the flipper's interpreter can start after 100 loads have finished (CI saw
        # 100 inside, 0 refused): wait until it has flipped once, then load until both outcomes were met.
        deadline = time.monotonic() + 60
        while os.readlink(art_dir / "oscar.json") != str(outside):
            assert flipper.poll() is None and time.monotonic() < deadline, "the flipper never flipped the link"
        loads = 0
        while loads < 100 or min(seen.values()) == 0:  # the old check-then-open read from outside in 1 load of 5
            assert time.monotonic() < deadline, seen
            loads += 1
            try:
                art = load_artifact(art_dir)
            except ArtifactError as e:
                assert "a symbolic link leaving the artifact directory" in str(e), e
                seen["refused"] += 1
            except ArtifactMissing:  # between the unlink and the link of a replace (no replace is atomic here)
                continue
            else:
                assert art.config == {"where": "inside"}, "read from outside the artifact"
                seen["inside"] += 1
    finally:
        flipper.kill()
        flipper.wait()
    assert seen["inside"] > 0 and seen["refused"] > 0, seen
