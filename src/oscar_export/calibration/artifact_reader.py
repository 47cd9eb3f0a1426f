"""Reading an artifact's two files as hostile input: each opened once and checked on its descriptor, every
size bounded by ``LIMITS`` before it is read, the tensor file hashed as it streams and its safetensors header
parsed here (no ``safetensors`` code runs on untrusted bytes).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch

from oscar_export.kernels.layout import KVCacheLayout

from .artifact_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LIMITS,
    META_FILE,
    REQUIRED_META_KEYS,
    TENSOR_FIELDS,
    TENSOR_FILE,
    ArtifactError,
    ArtifactMissing,
    layer_shapes,
)
from .safe_json import describe, json_bool, json_int, json_kind, json_object, parse_json, printable


def open_artifact_file(d: Path, name: str) -> tuple[Path, os.stat_result, Any]:
    """``(path, stat, open file)`` of ``d / name``: a regular file inside ``d`` (a symlink may point within ``d``
    only). Opened once; what is checked is the opened file (``fstat``, and where it lies by its descriptor), so a
    link flipped between a check and the read cannot smuggle in another file. The caller closes the file."""
    p = d / name
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # NONBLOCK: a FIFO cannot hang
    except FileNotFoundError:
        dangling = os.path.islink(p)
        raise ArtifactMissing(f"not an OSCAR artifact: {printable(p)} is missing"
                              f"{' (dangling link)' if dangling else ''}") from None
    except OSError as e:  # unreadable directory, a path too long, a link loop...: not "missing"
        raise ArtifactError(f"{printable(p)}: cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "directory" if stat.S_ISDIR(st.st_mode) else "FIFO" if stat.S_ISFIFO(st.st_mode) else "special file"
            raise ArtifactError(f"{printable(p)}: expected a regular file, got a {kind}")
        opened = Path(os.readlink(f"/proc/self/fd/{fd}")) if os.path.isdir("/proc/self/fd") else None
        base = d.resolve()
        if (opened is not None and not opened.is_relative_to(base)) or (opened is None and p.is_symlink()
                                                                        and not p.resolve().is_relative_to(base)):
            real = opened if opened is not None else p.resolve()
            raise ArtifactError(f"{printable(p)}: a symbolic link leaving the artifact directory (to "
                                f"{printable(real)}); copy the file into the artifact instead")
        os.set_blocking(fd, True)
        return p, st, os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_meta(d: Path) -> dict[str, Any]:
    path, st, f = open_artifact_file(d, META_FILE)
    where = printable(path)
    with f:
        if st.st_size > LIMITS.max_meta_bytes:
            raise ArtifactError(f"{where}: expected at most {LIMITS.max_meta_bytes:,} bytes, got {st.st_size:,}")
        raw = f.read(st.st_size + 1)  # read(n) allocates n bytes up front: n is the checked size
    if len(raw) > st.st_size:
        raise ArtifactError(f"{where}: expected at most {LIMITS.max_meta_bytes:,} bytes, got more")
    meta = parse_json(raw, where)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        got = describe(meta.get("format")) if isinstance(meta, dict) else json_kind(meta)
        raise ArtifactError(f"{where}: expected format {FORMAT_NAME!r}, got {got}")
    version = meta.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise ArtifactError(f"{where}: unsupported format_version {describe(version)} "
                            f"(this build reads {FORMAT_VERSION})")
    for key in REQUIRED_META_KEYS:
        if key not in meta:
            raise ArtifactError(f"{where}: missing key {key!r}")
    json_int(meta["num_layers"], f"{where}: num_layers", 1, LIMITS.max_layers)
    json_bool(meta["values_prerotated"], f"{where}: values_prerotated")
    sha = meta["tensor_sha256"]
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ArtifactError(f"{where}: tensor_sha256: expected 64 hex digits, got {describe(sha)}")
    if meta.get("tensor_file", TENSOR_FILE) != TENSOR_FILE:
        raise ArtifactError(f"{where}: tensor_file: expected {TENSOR_FILE!r}, got {describe(meta['tensor_file'])}")
    for key in ("config", "stats"):
        if key in meta:
            json_object(meta[key], f"{where}: {key}")
    return meta

def read_tensor_file(d: Path, meta: dict[str, Any], layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """The tensors of ``rotations.safetensors``, with every size bounded before it is read.

    The file size is checked against what the layout implies, the file is read in chunks (hashed as it
    streams) into one buffer of that size, the checksum compared, and only then is the header parsed (its
    length bounded; names, dtypes, shapes and offsets checked) and the tensors made from the buffer.
    """
    tpath, st, f = open_artifact_file(d, TENSOR_FILE)
    with f:
        return _read_tensor_stream(f, st, tpath, meta, layout)


def _read_tensor_stream(f, st: os.stat_result, tpath: Path, meta: dict[str, Any],
                        layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """:func:`read_tensor_file` on the opened file ``f`` (``st``: its ``fstat``)."""
    where = printable(tpath)
    n, h, dd = meta["num_layers"], layout.num_kv_heads, layout.head_dim
    shapes = layer_shapes(h, dd)
    data_bytes = n * 4 * sum(math.prod(s) for s in shapes.values())
    if data_bytes > LIMITS.max_tensor_bytes:
        raise ArtifactError(f"{where}: {n} layers x {h} KV heads x head_dim {dd} imply {data_bytes:,} bytes of "
                            f"tensors, above the limit {LIMITS.max_tensor_bytes:,}")
    header_max = LIMITS.header_bytes_base + LIMITS.header_bytes_per_tensor * n * len(TENSOR_FIELDS)
    size_max = 8 + header_max + data_bytes
    if st.st_size > size_max:
        raise ArtifactError(f"{where}: expected at most {size_max:,} bytes for {n} layers x {h} KV heads x head_dim "
                            f"{dd}, got {st.st_size:,} bytes (not this artifact's tensor file)")
    buf = bytearray(st.st_size)
    view = memoryview(buf)
    sha = hashlib.sha256()
    pos = 0
    while pos < len(buf):
        got = f.readinto(view[pos: pos + LIMITS.chunk_bytes])
        if not got:
            raise ArtifactError(f"{where}: file shrank while being read ({pos:,} of {len(buf):,} bytes)")
        sha.update(view[pos: pos + got])
        pos += got
    if f.read(1):
        raise ArtifactError(f"{where}: file grew while being read (more than {len(buf):,} bytes)")
    if sha.hexdigest() != meta["tensor_sha256"]:
        raise ArtifactError(f"{where}: checksum mismatch (file truncated or modified): expected sha256 "
                            f"{meta['tensor_sha256']}, got {sha.hexdigest()} ({len(buf):,} bytes)")

    def unreadable(why: str) -> ArtifactError:
        return ArtifactError(f"{where}: unreadable safetensors file ({why})")

    if len(buf) < 8:
        raise unreadable(f"{len(buf)} bytes, no header")
    hlen = int.from_bytes(buf[:8], "little")
    if hlen > header_max:
        raise unreadable(f"header of {hlen:,} bytes: expected at most {header_max:,}")
    if 8 + hlen > len(buf):
        raise unreadable(f"header of {hlen:,} bytes runs past the end of the {len(buf):,}-byte file")
    try:
        header = parse_json(bytes(view[8: 8 + hlen]), "header")
    except ArtifactError as e:
        raise unreadable(str(e)) from None
    if not isinstance(header, dict):
        raise unreadable(f"header: expected a JSON object, got {json_kind(header)}")
    header.pop("__metadata__", None)
    expected = {f"layers.{i}.{name}" for i in range(n) for name in TENSOR_FIELDS}
    if set(header) != expected:
        missing, extra = sorted(expected - set(header)), sorted(printable(k, 60) for k in set(header) - expected)
        raise ArtifactError(
            f"{where}: tensor names do not match {n} layers: missing {missing[:4]}{'...' if len(missing) > 4 else ''}"
            f", unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}"
        )
    data_len = len(buf) - 8 - hlen
    spans = []
    for name in sorted(expected, key=lambda k: (int(k.split(".")[1]), TENSOR_FIELDS.index(k.split(".")[2]))):
        e = header[name]
        shape = shapes[name.split(".")[2]]
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise unreadable(f"{name}: expected {{dtype, shape, data_offsets}}, got {json_kind(e)}")
        if e["dtype"] != "F32":
            raise ArtifactError(f"{name}: expected float32 (F32), got {describe(e['dtype'])}")
        s = e["shape"]
        if not isinstance(s, list) or len(s) > 8 or not all(type(v) is int for v in s) or tuple(s) != shape:
            got = tuple(s) if isinstance(s, list) and len(s) <= 8 else describe(s)
            raise ArtifactError(f"{name}: expected {list(shape)}, got {got}")
        off = e["data_offsets"]
        nbytes = 4 * math.prod(shape)
        if (not isinstance(off, list) or len(off) != 2 or not all(type(v) is int for v in off)
                or not 0 <= off[0] <= off[1] <= data_len or off[1] - off[0] != nbytes):
            raise unreadable(f"{name}: data_offsets {describe(off) if not isinstance(off, list) else off[:2]} do not "
                             f"hold {nbytes} bytes inside the {data_len:,}-byte data section")
        spans.append((off[0], off[1], name))
    spans.sort()
    end = 0
    for b, e_, name in spans:
        if b != end:
            raise unreadable(f"{name}: tensor data overlaps or leaves a gap at byte {min(b, end):,}")
        end = e_
    if end != data_len:
        raise unreadable(f"{data_len - end:,} bytes after the last tensor")
    base = 8 + hlen
    out = {}
    for b, e_, name in spans:
        t = torch.frombuffer(buf, dtype=torch.float32, count=(e_ - b) // 4, offset=base + b)
        if (base + b) % 4:  # a header length that is not a multiple of 4: copy to an aligned tensor
            t = t.clone()
        out[name] = t.view(shapes[name.split(".")[2]])
    return out


__all__ = ["open_artifact_file", "read_meta", "read_tensor_file"]
