"""The OSCAR artifact: what calibration produces and everything downstream reads (docs/design.md §3.3).

:class:`OscarArtifact` (per-layer transforms and the cache layout they were fitted for), :meth:`OscarArtifact.save`
and :func:`load_artifact`. The pieces, one module each:

* :mod:`.artifact_format` — the files, their fields, the error types and the bounds (``LIMITS``);
* :mod:`.safe_json` — strict JSON and terminal-safe error text;
* :mod:`.fingerprint` — what an artifact must match of its model;
* :mod:`.artifact_checks` — validation of the layout, key widths and transforms;
* :mod:`.artifact_reader` — both files read as hostile input (the safetensors header parsed there).

:func:`load_artifact` bounds its work before trusting anything (file sizes, counts and nesting checked against
``LIMITS`` before any allocation that depends on them; the tensor file read in chunks and hashed as it streams),
type-checks every JSON field, checks every tensor's range, and raises one :class:`ArtifactError` (a
``ValueError``) naming what was expected and what came.

The names other modules import from here (``LIMITS``, ``META_FILE``, ``printable``, ``parse_json``...) are
re-exported below from their homes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

from .artifact_checks import parse_key_bits, parse_layout, validate
from .artifact_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LIMITS,
    META_FILE,
    ORTHO_TOL,
    TENSOR_FIELDS,
    TENSOR_FILE,
    ArtifactError,
    ArtifactLimits,
    ArtifactMissing,
)
from .artifact_reader import read_meta, read_tensor_file
from .families import family_for
from .fingerprint import fingerprint_mismatches, jsonable, model_fingerprint, parse_fingerprint, text_config
from .safe_json import json_int, parse_json, printable


@dataclass(frozen=True)
class OscarArtifact:
    """Calibrated per-layer transforms plus the cache layout they were fitted for.

    Args:
        layout: the cache layout (row formats, windows, page size) every layer uses.
        transforms: one :class:`LayerTransform` per layer (``[H_kv, ...]`` tensors even when shared).
        fingerprint: :func:`model_fingerprint` of the calibrated model.
        config: the calibration config (JSON-serialisable dict).
        stats: calibration statistics (JSON-serialisable dict, e.g. per-layer errors).
        key_bits: key code width per layer (each in ``CODE_BITS``); empty (the default) = 2 in every layer.
    """

    layout: KVCacheLayout
    transforms: tuple[LayerTransform, ...]
    fingerprint: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    key_bits: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "transforms", tuple(self.transforms))
        bits = self.key_bits
        if isinstance(bits, (list, tuple)) and len(bits) == 0:
            bits = (2,) * len(self.transforms)
        object.__setattr__(self, "key_bits", tuple(bits) if isinstance(bits, (list, tuple)) else bits)
        validate(self)

    @property
    def num_layers(self) -> int:
        return len(self.transforms)

    def layer_layout(self, i: int) -> KVCacheLayout:
        """The cache layout of layer ``i``: :attr:`layout` with its ``key_bits[i]``-bit key codes."""
        return self.layout.per_layer(self.key_bits)[i]

    @property
    def mixed_key_bits(self) -> bool:
        """Whether any layer stores keys wider than the base layout's 2 bits."""
        return any(b != self.layout.key.bits for b in self.key_bits)

    def with_key_bits(self, key_bits: Sequence[int]) -> "OscarArtifact":
        """The same artifact with per-layer key widths ``key_bits`` (validated)."""
        return replace(self, key_bits=key_bits)

    @classmethod
    def identity(
        cls, model_config: Any, layout: KVCacheLayout | None = None, k_clip: float = 1.0, v_clip: float = 1.0,
        **config: Any,
    ) -> "OscarArtifact":
        """No rotation, scaling, means or codebook (plain INT2; a baseline). Default layout: token keys."""
        fp = model_fingerprint(model_config)
        if layout is None:
            layout = KVCacheLayout.default(fp["num_key_value_heads"], fp["head_dim"])
        ts = [
            LayerTransform.identity(layout.num_kv_heads, layout.head_dim, k_clip, v_clip)
            for _ in range(fp["num_hidden_layers"])
        ]
        return cls(layout, tuple(ts), fp, {"method": "identity", **config}, {})

    def check_model(self, config: Any) -> None:
        """Raise :class:`ArtifactError` unless ``config`` (a HF config or model) is the model calibrated for
        (and its sliding-window layers, which the cache keeps in BF16, have 2-bit ``key_bits``)."""
        bad = fingerprint_mismatches(self.fingerprint, model_fingerprint(config))
        if bad:
            raise ArtifactError(
                f"OSCAR artifact does not match this model ({self.fingerprint.get('name')!r} "
                f"{self.fingerprint.get('model_type')} calibrated): " + "; ".join(bad)
            )
        wide = [i for i in family_for(text_config(config)).sliding_layers if self.key_bits[i] != 2]
        if wide:
            raise ArtifactError(f"key_bits: layers {wide} are sliding-window layers (kept in BF16, never paged) "
                                f"and must be 2, got {[self.key_bits[i] for i in wide]}")
        folded = values_folded(config)
        if any(t.values_prerotated != folded for t in self.transforms):
            use = "its oscar_artifact/" if folded else "the original model with the artifact of calibrate"
            raise ArtifactError(
                f"values_prerotated: the artifact's value rotation is {'' if not folded else 'not '}folded into "
                f"v_proj / o_proj, this model's is {'' if folded else 'not '}(an exported checkpoint serves with the "
                f"artifact it bundles, {use})")

    def with_values_prerotated(self, flag: bool = True) -> "OscarArtifact":
        """The same artifact for a checkpoint whose ``v_proj``/``o_proj`` already fold ``R_V``/``d_V``."""
        return replace(self, transforms=tuple(replace(t, values_prerotated=flag) for t in self.transforms))

    def bits_per_element(self, length: int | None = None) -> float:
        """INT2 history bits per K/V element, or of a whole ``length``-token sequence with the BF16 windows
        (averaged over the layers' own layouts, :meth:`layer_layout`)."""
        lays = [self.layer_layout(i) for i in range(self.num_layers)]
        if length is None:
            return sum(lay.int2_bits_per_element() for lay in lays) / len(lays)
        return sum(lay.effective_bits_per_element(length) for lay in lays) / len(lays)

    # ---- files ---------------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """``{"layers.{i}.{field}": fp32 tensor}`` as written to ``rotations.safetensors``."""
        out = {}
        for i, t in enumerate(self.transforms):
            for name in TENSOR_FIELDS:
                out[f"layers.{i}.{name}"] = getattr(t, name).detach().to("cpu", torch.float32).contiguous().clone()
        return out

    def metadata(self, tensor_sha256: str) -> dict[str, Any]:
        prerot = {t.values_prerotated for t in self.transforms}
        wide = {"key_bits": list(self.key_bits)} if self.mixed_key_bits else {}
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "num_layers": self.num_layers,
            "values_prerotated": prerot.pop() if len(prerot) == 1 else None,
            "fingerprint": jsonable(self.fingerprint),
            "layout": self.layout.to_dict(),
            **wide,
            "config": jsonable(self.config),
            "stats": jsonable(self.stats),
            "tensor_file": TENSOR_FILE,
            "tensor_sha256": tensor_sha256,
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``oscar.json`` and ``rotations.safetensors`` into ``directory`` (created)."""
        if len({t.values_prerotated for t in self.transforms}) != 1:
            raise ValueError("OscarArtifact.save: layers disagree on values_prerotated")
        return write_files(directory, self.metadata(""), self.tensors())



def values_folded(config: Any) -> bool:
    """Whether a model (or its config) has the value transform folded into ``v_proj`` / ``o_proj``: the checkpoint
    ``export`` wrote says so in its config's ``oscar`` section (``values_prerotated``)."""
    config = getattr(config, "config", config)  # a model was passed
    for c in (config, text_config(config)):
        section = c.get("oscar") if isinstance(c, dict) else getattr(c, "oscar", None)
        if isinstance(section, dict):
            return section.get("values_prerotated") is True
    return False


def write_file_atomic(path: str | Path, data: bytes) -> Path:
    """Write one file whole or not at all: a temporary sibling (a name no other writer takes), fsync, then a rename
    over ``path``; on any error (a full disk) the temporary is removed and ``path`` is left as it was.

    One file, not ``oscar_export.atomic_dir``'s whole-directory transaction: :meth:`OscarArtifact.save` writes into
    any directory (a test's, a checkpoint's ``oscar/``), where ``atomic_dir`` replaces only an empty directory or
    its own earlier output; the evaluation writes its report files in place (``eval --out``) with it too. The CLI's
    outputs wrap ``save`` in ``atomic_dir``."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.oscar-partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def write_files(directory: str | Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Low-level writer: the tensor file, then ``meta`` with its sha256 filled in (tests tamper through it).

    Each file is replaced atomically and ``oscar.json`` last, so a process killed half way leaves either the
    old artifact, or a new tensor file beside the old ``oscar.json`` (refused by its checksum), never a mix
    that loads. A whole directory written as one transaction is ``oscar_export.atomic_dir`` (the CLI uses it).
    """
    from safetensors.torch import save

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    blob = save(tensors, metadata={"format": FORMAT_NAME})
    write_file_atomic(d / TENSOR_FILE, blob)
    meta = dict(meta, tensor_sha256=hashlib.sha256(blob).hexdigest())
    write_file_atomic(d / META_FILE, (json.dumps(meta, indent=1, allow_nan=False) + "\n").encode())
    try:  # the directory entry itself (both renames) reaches the disk
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    return d


def load_artifact(directory: str | Path, model_config: Any = None) -> OscarArtifact:
    """Read and validate an artifact directory; with ``model_config`` also check it matches that model.

    Raises :class:`ArtifactMissing` (also a ``FileNotFoundError``) for a missing file and :class:`ArtifactError`
    (a ``ValueError``; one message naming the problem) for anything else: sizes and counts beyond
    :data:`LIMITS`, JSON types, symlinks leaving the directory, format/version, checksum (truncated or edited
    tensor file), tensor names, shapes, dtypes, finiteness, ranges, orthogonality, clip ratios, scalings,
    levels, fingerprint. Work and memory are bounded by the limits before anything from the files is trusted.
    """
    d = Path(directory)
    meta = read_meta(d)
    where = printable(d / META_FILE)
    try:
        layout = parse_layout(meta["layout"])
    except ArtifactError as e:
        raise ArtifactError(f"{where}: invalid layout ({e})") from None
    fp = parse_fingerprint(meta["fingerprint"])
    if (layout.num_kv_heads, layout.head_dim) != (fp["num_key_value_heads"], fp["head_dim"]):
        raise ArtifactError(
            f"{where}: layout has {layout.num_kv_heads} KV heads x head_dim {layout.head_dim}, "
            f"the fingerprint {(fp['num_key_value_heads'], fp['head_dim'])}"
        )
    n = meta["num_layers"]
    if n != fp["num_hidden_layers"]:
        raise ArtifactError(f"{where}: num_layers: expected {fp['num_hidden_layers']} (the fingerprint's "
                            f"num_hidden_layers), got {n}")
    tensors = read_tensor_file(d, meta, layout)
    prerot = meta["values_prerotated"]
    transforms = []
    for i in range(n):
        kw = {name: tensors[f"layers.{i}.{name}"] for name in TENSOR_FIELDS}
        for name, t in kw.items():
            if not bool(torch.isfinite(t).all()):
                raise ArtifactError(f"layers.{i}.{name}: {int((~torch.isfinite(t)).sum())} non-finite values (NaN/Inf)")
        try:
            transforms.append(LayerTransform(**kw, values_prerotated=prerot))
        except ValueError as e:
            raise ArtifactError(f"layers.{i}: {e}") from None
    key_bits = parse_key_bits(meta["key_bits"], n, layout, f"{where}: key_bits") if "key_bits" in meta else ()
    art = OscarArtifact(layout, tuple(transforms), fp, meta.get("config", {}), meta.get("stats", {}), key_bits)
    if model_config is not None:
        art.check_model(model_config)
    return art


__all__ = [
    "LIMITS",
    "META_FILE",
    "TENSOR_FIELDS",
    "TENSOR_FILE",
    "ArtifactError",
    "ArtifactLimits",
    "ArtifactMissing",
    "FORMAT_VERSION",
    "ORTHO_TOL",
    "OscarArtifact",
    "fingerprint_mismatches",
    "load_artifact",
    "model_fingerprint",
    "json_int",
    "parse_fingerprint",
    "parse_json",
    "parse_key_bits",
    "parse_layout",
    "printable",
    "validate",
    "values_folded",
    "write_files",
    "write_file_atomic",
]
