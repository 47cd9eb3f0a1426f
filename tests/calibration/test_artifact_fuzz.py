"""Fuzzing the artifact loader: a fixed seed, a fixed number of mutated artifacts, each ends well.

Every case is a small valid artifact with one random mutation: byte flips in ``oscar.json`` or in the tensor
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
import random
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaConfig

from oscar_export.calibration.artifact import OscarArtifact, load_artifact, write_files
from oscar_export.calibration.artifact_checks import validate
from oscar_export.calibration.artifact_format import META_FILE, TENSOR_FILE, ArtifactError
from oscar_export.calibration.fingerprint import model_fingerprint
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

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
