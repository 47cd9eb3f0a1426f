"""The OSCAR artifact: what calibration produces and everything downstream reads (docs/design.md §3.3).

On disk, a directory::

    oscar.json              format name + version, model fingerprint, cache layout (row formats, windows),
                            calibration config and statistics, sha256 of the tensor file
    rotations.safetensors   per layer i, per KV head (a shared rotation is stored once per head anyway):
                            layers.{i}.k_rotation  fp32 [H_kv, D, D]   (x_rot = x @ R)
                            layers.{i}.v_rotation  fp32 [H_kv, D, D]
                            layers.{i}.k_scale / v_scale    fp32 [H_kv, D]  (> 0)
                            layers.{i}.k_mean  / v_mean     fp32 [H_kv, D]
                            layers.{i}.k_clip  / v_clip     fp32 [H_kv]     (in (0, 1])
                            layers.{i}.k_levels / v_levels  fp32 [H_kv, 4]  (strictly ascending, in [0, 3])

``oscar.json`` may also hold ``key_bits``: one code width per layer (each in ``layout.CODE_BITS``; issue 17's
wider keys). Absent means every layer stores 2-bit keys (every artifact written before the field existed);
the writer leaves it out unless a layer has 4-bit keys. ``layout`` stays the base (2-bit) layout; layer ``i``
uses :meth:`OscarArtifact.layer_layout` ``= layout.with_key_bits(key_bits[i])``. Layers the model-family table
marks sliding (kept in BF16, never paged) must say 2 (:meth:`OscarArtifact.check_model`).

No pickle anywhere: JSON and safetensors only, so loading an artifact from a stranger runs no code.
:func:`load_artifact` treats both files as hostile: it bounds its work before trusting anything (file sizes,
counts and nesting checked against :data:`LIMITS` before any allocation that depends on them; the tensor file
read in chunks and hashed as it streams; its header parsed by this module with a size bound), type-checks
every JSON field (a bool is a bool, an int an int), checks every tensor's range, and raises one
:class:`ArtifactError` (a ``ValueError``) naming what was expected and what came.
Rotations are stored in fp32; orthogonality is checked in fp64 as ``max |R^T R - I| <= ORTHO_TOL``
(``1e-5``: fp32 rounding of an exactly orthogonal ``D <= 256`` matrix stays below ~1e-6).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from oscar_export.kernels.layout import CODE_BITS, UNIFORM_LEVELS, KVCacheLayout, check_packing
from oscar_export.kernels.transform import LayerTransform

from .codebook import MIN_GAP as MIN_LEVEL_GAP
from .families import family_for, rope_parameters

FORMAT_NAME = "oscar-kv-artifact"
FORMAT_VERSION = 1
META_FILE = "oscar.json"
TENSOR_FILE = "rotations.safetensors"
#: max |R^T R - I| (fp64) accepted for a stored fp32 rotation.
ORTHO_TOL = 1e-5
#: LayerTransform tensor fields, in file order.
TENSOR_FIELDS = (
    "k_rotation", "v_rotation", "k_scale", "v_scale", "k_mean", "v_mean", "k_clip", "v_clip", "k_levels",
    "v_levels",
)
#: fingerprint keys that must agree between the artifact and the model it is applied to.
FINGERPRINT_KEYS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "vocab_size", "rope",
)
#: fingerprint keys compared when the artifact has them (artifacts written before they existed lack them).
OPTIONAL_FINGERPRINT_KEYS = ("attention_scaling",)


class ArtifactError(ValueError):
    """Anything wrong with an artifact: one line naming the file or field, what was expected and what came."""


class ArtifactMissing(ArtifactError, FileNotFoundError):
    """A file of the artifact is missing (also a ``FileNotFoundError``)."""


@dataclass(frozen=True)
class ArtifactLimits:
    """Every bound :func:`load_artifact` checks before it trusts a number from the files (stated once, here).

    Sizes and counts (generous for real models: Llama-3-405B has 126 layers, 8 KV heads, head_dim 128, and
    its tensor file would be ~130 MB):

    * ``max_meta_bytes``: ``oscar.json`` is refused above this size before it is read.
    * ``max_json_depth``: nesting of any JSON document (``oscar.json``, the safetensors header); the writer
      produces depth <= 5.
    * ``max_layers``, ``max_kv_heads``, ``max_heads``, ``min/max_head_dim``, ``max_hidden_size``,
      ``max_vocab_size``: the fingerprint and layout.
    * ``max_sink``, ``max_window``, ``min/max_page_size``: the cache windows (docs/design.md §3.2 defaults 64, 256, 64).
    * ``max_tensor_bytes``: tensor data the layout implies (``L * H_kv * (2 D^2 + 4 D + 10) * 4`` bytes).
    * the safetensors header may use at most ``header_bytes_base + header_bytes_per_tensor * tensors`` bytes
      (the writer uses ~100 per tensor), so the whole file may be at most ``8 + header + data`` bytes, checked
      against its size on disk before a byte is read.

    Tensor ranges (so that the fp16 ``(scale, lo)`` page params an artifact implies are finite). A stored
    coordinate is ``x_i * d_i - mu_i`` (``kernels/transform.py``); the page params are ``lo = min`` and
    ``scale = (max - min) / 3`` of such values, and must stay below ``fp16_max`` = 65504:

    * ``|mu| <= mean_abs_max`` = 2^14;
    * ``scale_min <= d <= scale_max`` = 2^-12 .. 2^12 (keys are multiplied by ``d``, queries by ``1/d``).
      Calibrated scalings have geometric mean 1 and ``max/min <= sqrt(D / 1e-3)``
      (``rotation.whitening_scale``'s energy floor), i.e. within [1/716, 716] for D <= 512.
    * then a row whose rotated coordinates are within ``row_abs`` = 8 model units at the largest scale maps
      to ``|x d - mu| <= 8 * 2^12 + 2^14 = 49152 < 65504``: ``lo`` and ``scale`` are finite
      (``tests/calibration/test_artifact_hostile.py::test_limits_keep_fp16_params_finite``); at ``d = 1`` the
      same holds for coordinates up to 49,120.
    """

    max_meta_bytes: int = 16 << 20
    max_json_depth: int = 32
    max_layers: int = 1024
    max_kv_heads: int = 256
    max_heads: int = 4096
    min_head_dim: int = 16
    max_head_dim: int = 512
    max_hidden_size: int = 1 << 20
    max_vocab_size: int = 1 << 24
    max_sink: int = 1 << 14
    max_window: int = 1 << 16
    min_page_size: int = 16
    max_page_size: int = 1024
    max_tensor_bytes: int = 4 << 30
    header_bytes_base: int = 4096
    header_bytes_per_tensor: int = 256
    chunk_bytes: int = 1 << 20
    fp16_max: float = 65504.0
    mean_abs_max: float = 2.0 ** 14
    scale_min: float = 2.0 ** -12
    scale_max: float = 2.0 ** 12
    row_abs: float = 8.0


LIMITS = ArtifactLimits()


# ---- safe strings ---------------------------------------------------------------------------------------------


def printable(x: Any, limit: int = 200) -> str:
    """``str(x)`` safe for a terminal: control and format characters (ESC, CR, BEL, bidi overrides, C1...)
    written as ``\\xNN`` / ``\\uNNNN`` escapes, at most ``limit`` characters (``...`` marks a cut)."""
    s = x if isinstance(x, str) else str(x)
    out = []
    n = 0
    for c in s[: limit + 1]:
        if c.isprintable():
            e = c
        else:
            o = ord(c)
            e = f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"
        out.append(e)
        n += len(e)
        if n > limit:
            break
    text = "".join(out)
    return text if len(text) <= limit and len(s) <= limit else text[: limit - 3] + "..."


def _got(x: Any) -> str:
    """A short, terminal-safe description of a JSON value for an error message."""
    if isinstance(x, str):
        return repr(printable(x, 60))
    if isinstance(x, bool) or x is None:
        return repr(x)
    if isinstance(x, int):
        return repr(x) if abs(x) < 10**30 else f"an int of {len(str(abs(x)))} digits"
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, list):
        return "a list"
    if isinstance(x, dict):
        return "a JSON object"
    return f"a {type(x).__name__}"


def json_int(x: Any, where: str, lo: int, hi: int, multiple_of: int = 1) -> int:
    """``x`` if it is a JSON int (not a bool, not 3.0) in ``[lo, hi]``, else :class:`ArtifactError`."""
    if type(x) is not int or not lo <= x <= hi or x % multiple_of:
        what = f"a multiple of {multiple_of} in" if multiple_of > 1 else "an int in"
        raise ArtifactError(f"{where}: expected {what} [{lo}, {hi}], got {_got(x)}")
    return x


def _bool(x: Any, where: str) -> bool:
    if type(x) is not bool:
        raise ArtifactError(f"{where}: expected true or false, got {_got(x)}")
    return x


def _kind(x: Any) -> str:
    """The JSON type of ``x`` in words."""
    if x is None:
        return "null"
    names = {dict: "a JSON object", list: "a list", str: "a str", bool: "a bool", int: "an int", float: "a float"}
    return names.get(type(x), f"a {type(x).__name__}")


def _str(x: Any, where: str, limit: int = 256, optional: bool = False) -> str | None:
    if optional and x is None:
        return None
    if not isinstance(x, str) or len(x) > limit:
        got = f"{len(x)} characters" if isinstance(x, str) else _kind(x)
        raise ArtifactError(f"{where}: expected a string of at most {limit} characters"
                            f"{' or null' if optional else ''}, got {got}")
    return x


def _dict(x: Any, where: str, optional: bool = False) -> dict | None:
    if optional and x is None:
        return None
    if not isinstance(x, dict):
        raise ArtifactError(f"{where}: expected a JSON object{' or null' if optional else ''}, got {_kind(x)}")
    return x


def _keys(d: dict, where: str, required: Sequence[str], allowed: Sequence[str] | None = None) -> None:
    missing = [k for k in required if k not in d]
    if missing:
        raise ArtifactError(f"{where}: missing keys {missing}")
    if allowed is not None:
        extra = sorted(printable(k, 40) for k in d if k not in allowed)
        if extra:
            raise ArtifactError(f"{where}: unexpected keys {extra[:4]}{'...' if len(extra) > 4 else ''}")


def json_depth(x: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), computed without recursion."""
    depth, stack = 0, [(x, 0)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            d += 1
            depth = max(depth, d)
            stack.extend((v, d) for v in (node.values() if isinstance(node, dict) else node))
    return depth


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {printable(text, 40)} is not finite in float64")
    return v


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct (a repeated key is refused: which value counts is ambiguous)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {printable(dup, 80)!r} in one object")
    return out


def parse_json(text: str | bytes, where: str) -> Any:
    """Strict JSON: finite numbers only, nesting at most ``LIMITS.max_json_depth``; raises :class:`ArtifactError`."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        value = json.loads(text, parse_float=_finite_float, parse_constant=_reject_constant,
                           object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ArtifactError(f"{where}: not valid JSON (nested deeper than {LIMITS.max_json_depth} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{where}: not valid JSON ({printable(e, 160)})") from None
    if json_depth(value) > LIMITS.max_json_depth:
        raise ArtifactError(f"{where}: not valid JSON (nested deeper than {LIMITS.max_json_depth} levels)")
    return value


# ---- model fingerprint ---------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    """Plain JSON types (floats stay floats, tuples become lists, keys sorted)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(x[k]) for k in sorted(x, key=str)}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, float):
        return float(x)
    return str(x)


def _text_config(config: Any) -> Any:
    """The config of the language model (``model.config`` or a multimodal config's text part)."""
    config = getattr(config, "config", config)  # a model was passed
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def model_fingerprint(config: Any) -> dict[str, Any]:
    """What an artifact must match: architecture, layers, heads, head_dim, scale, widths and RoPE parameters.

    The attention facts come from the model-family table (``families.family_for``: raises its
    ``NotImplementedError`` for a model the cache cannot serve).

    Args:
        config: a Hugging Face ``PretrainedConfig`` (or a model; its ``.config`` is used).
    """
    c = _text_config(config)
    f = family_for(c)
    archs = getattr(c, "architectures", None) or []
    return _jsonable({
        "model_type": f.model_type,
        "architecture": archs[0] if archs else None,
        "num_hidden_layers": f.num_layers,
        "num_attention_heads": f.num_heads,
        "num_key_value_heads": f.num_kv_heads,
        "head_dim": f.head_dim,
        "attention_scaling": f.scaling,
        "hidden_size": int(c.hidden_size),
        "vocab_size": int(getattr(c, "vocab_size", 0) or 0),
        "rope": rope_parameters(c),
        "name": getattr(c, "_name_or_path", None) or getattr(c, "_model_name_or_path", None),
    })


def fingerprint_mismatches(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """``["num_hidden_layers: artifact 30, model 24", ...]`` for every key of :data:`FINGERPRINT_KEYS` that differs
    (and of :data:`OPTIONAL_FINGERPRINT_KEYS` that the artifact records)."""
    keys = FINGERPRINT_KEYS + tuple(k for k in OPTIONAL_FINGERPRINT_KEYS if k in expected)
    return [
        f"{k}: artifact {expected.get(k)!r}, model {got.get(k)!r}"
        for k in keys
        if _jsonable(expected.get(k)) != _jsonable(got.get(k))
    ]


# ---- the artifact ------------------------------------------------------------------------------------------


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
        return self.layout.with_key_bits(self.key_bits[i])

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
        wide = [i for i in family_for(_text_config(config)).sliding_layers if self.key_bits[i] != 2]
        if wide:
            raise ArtifactError(f"key_bits: layers {wide} are sliding-window layers (kept in BF16, never paged) "
                                f"and must be 2, got {[self.key_bits[i] for i in wide]}")

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
            "fingerprint": _jsonable(self.fingerprint),
            "layout": self.layout.to_dict(),
            **wide,
            "config": _jsonable(self.config),
            "stats": _jsonable(self.stats),
            "tensor_file": TENSOR_FILE,
            "tensor_sha256": tensor_sha256,
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``oscar.json`` and ``rotations.safetensors`` into ``directory`` (created)."""
        if len({t.values_prerotated for t in self.transforms}) != 1:
            raise ValueError("OscarArtifact.save: layers disagree on values_prerotated")
        return write_files(directory, self.metadata(""), self.tensors())


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` as a whole or not at all: a temporary sibling, fsync, rename over ``path``."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    _write_atomic(d / TENSOR_FILE, blob)
    meta = dict(meta, tensor_sha256=hashlib.sha256(blob).hexdigest())
    _write_atomic(d / META_FILE, (json.dumps(meta, indent=1, allow_nan=False) + "\n").encode())
    try:  # the directory entry itself (both renames) reaches the disk
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    return d


# ---- validation ----------------------------------------------------------------------------------------------


def _check_range(where: str, name: str, x: torch.Tensor) -> None:
    """The range checks of :class:`ArtifactLimits` (the fp16 page params an artifact implies stay finite)."""
    if name.endswith("_mean"):
        m = float(x.abs().max()) if x.numel() else 0.0
        if m > LIMITS.mean_abs_max:
            raise ArtifactError(
                f"{where}.{name}: max |value| {m:.3g} exceeds the limit {LIMITS.mean_abs_max:g} (stored rows are "
                f"x*d - mean; their fp16 page params must stay below {LIMITS.fp16_max:g}; see ArtifactLimits)"
            )
    elif name.endswith("_scale"):
        lo, hi = float(x.min()), float(x.max())
        if lo < LIMITS.scale_min or hi > LIMITS.scale_max:
            got = f"max {hi:.3g}" if hi > LIMITS.scale_max else f"min {lo:.3g}"
            raise ArtifactError(
                f"{where}.{name}: values must lie in [{LIMITS.scale_min:.3g}, {LIMITS.scale_max:g}], got {got} "
                f"(keys are multiplied by d, queries by 1/d; outside this range fp16 page params of ordinary rows "
                f"overflow or underflow (fp16 max {LIMITS.fp16_max:g}); see ArtifactLimits)"
            )


def _check_transform(i: int, t: LayerTransform, layout: KVCacheLayout) -> None:
    where = f"layers.{i}"
    if (t.num_kv_heads, t.head_dim) != (layout.num_kv_heads, layout.head_dim):
        raise ArtifactError(
            f"{where}: expected {layout.num_kv_heads} KV heads x head_dim {layout.head_dim}, "
            f"got {t.num_kv_heads} x {t.head_dim}"
        )
    for name in TENSOR_FIELDS:
        x = getattr(t, name)
        if not bool(torch.isfinite(x).all()):
            n = int((~torch.isfinite(x)).sum())
            raise ArtifactError(f"{where}.{name}: {n} non-finite values (NaN/Inf)")
        _check_range(where, name, x)
    eye = torch.eye(t.head_dim, dtype=torch.float64)
    for name in ("k_rotation", "v_rotation"):
        r = getattr(t, name).double()
        err = (r.transpose(-1, -2) @ r - eye).abs().amax(dim=(-1, -2))  # [H_kv]
        if bool((err > ORTHO_TOL).any()):
            h = int(err.argmax())
            raise ArtifactError(
                f"{where}.{name}: not orthogonal: max |R^T R - I| = {float(err[h]):.3g} at KV head {h} "
                f"(tolerance {ORTHO_TOL:g}, fp64)"
            )
    for name, fmt in (("k_levels", layout.key), ("v_levels", layout.value)):
        lv = getattr(t, name).double()
        if bool((lv < 0).any() or (lv > 3).any()) or bool((lv[:, 1:] <= lv[:, :-1]).any()):
            raise ArtifactError(f"{where}.{name}: levels must be strictly ascending in [0, 3], got {lv.tolist()}")
        gap = float((lv[:, 1:] - lv[:, :-1]).min())
        if gap < MIN_LEVEL_GAP * (1 - 1e-4):  # fp32 storage of the fitter's gaps
            raise ArtifactError(f"{where}.{name}: levels {lv.tolist()} are {gap:.3g} apart; expected at least "
                                f"{MIN_LEVEL_GAP} (calibration.codebook.MIN_GAP: levels closer than that waste a code)")
        uniform = bool(torch.equal(getattr(t, name), torch.tensor(UNIFORM_LEVELS).expand_as(lv)))
        if not fmt.codebook and not uniform:
            raise ArtifactError(
                f"{where}.{name}: non-uniform levels {lv.tolist()} but the layout's row format has codebook=False"
            )


def validate(art: OscarArtifact) -> None:
    """Everything :func:`load_artifact` checks beyond file integrity; raises :class:`ArtifactError`."""
    fp = art.fingerprint
    missing = [k for k in FINGERPRINT_KEYS if k not in fp]
    if missing:
        raise ArtifactError(f"fingerprint: missing keys {missing}")
    if art.num_layers != fp["num_hidden_layers"]:
        raise ArtifactError(
            f"transforms: expected one per layer ({fp['num_hidden_layers']} layers in the fingerprint), "
            f"got {art.num_layers}"
        )
    if (art.layout.num_kv_heads, art.layout.head_dim) != (fp["num_key_value_heads"], fp["head_dim"]):
        raise ArtifactError(
            f"layout: expected {fp['num_key_value_heads']} KV heads x head_dim {fp['head_dim']} (fingerprint), "
            f"got {art.layout.num_kv_heads} x {art.layout.head_dim}"
        )
    for i, t in enumerate(art.transforms):
        _check_transform(i, t, art.layout)
    parse_key_bits(art.key_bits, art.num_layers, art.layout)


def parse_key_bits(x: Any, num_layers: int, layout: KVCacheLayout, where: str = "key_bits") -> tuple[int, ...]:
    """Per-layer key code widths from untrusted JSON: a list of ``num_layers`` ints, each in ``CODE_BITS``,
    every wider one a row format ``layout`` can take (``layout.with_key_bits``)."""
    if not isinstance(x, (list, tuple)) or len(x) != num_layers:
        got = f"{len(x)} entries" if isinstance(x, (list, tuple)) else _kind(x)
        raise ArtifactError(f"{where}: expected a list of {num_layers} code widths (one per layer, each in "
                            f"{list(CODE_BITS)}), got {got}")
    for i, b in enumerate(x):
        if type(b) is not int or b not in CODE_BITS:
            raise ArtifactError(f"{where}[{i}]: expected one of {list(CODE_BITS)}, got {_got(b)}")
    for b in sorted(set(x) - {layout.key.bits}):
        try:
            layout.with_key_bits(b)
        except (ValueError, NotImplementedError) as e:
            raise ArtifactError(f"{where}: {b}-bit keys do not fit the layout's key format ({printable(e)})") from None
    return tuple(x)


# ---- reading: every field typed and bounded before it is used --------------------------------------------------

ROW_KEYS = ("head_dim", "group_size", "granularity", "bits", "codebook")
#: optional row-format keys: an artifact written before the field existed means its default ("linear").
ROW_OPTIONAL_KEYS = ("packing",)
LAYOUT_KEYS = ("num_kv_heads", "head_dim", "key", "value", "sink", "window", "page_size")
REQUIRED_META_KEYS = ("num_layers", "fingerprint", "layout", "tensor_sha256", "values_prerotated")


def parse_layout(x: Any, where: str = "layout") -> KVCacheLayout:
    """A :class:`KVCacheLayout` from untrusted JSON: exact keys, JSON types and :data:`LIMITS` checked first."""
    L = LIMITS
    d = _dict(x, where)
    _keys(d, where, LAYOUT_KEYS, LAYOUT_KEYS)
    for side in ("key", "value"):
        r = _dict(d[side], f"{where}.{side}")
        _keys(r, f"{where}.{side}", ROW_KEYS, ROW_KEYS + ROW_OPTIONAL_KEYS)
        if "packing" in r:
            try:
                check_packing(r["packing"], f"{where}.{side}.packing")
            except ValueError as e:
                raise ArtifactError(printable(e)) from None
        json_int(r["head_dim"], f"{where}.{side}.head_dim", L.min_head_dim, L.max_head_dim)
        json_int(r["group_size"], f"{where}.{side}.group_size", 4, L.max_head_dim)
        if not isinstance(r["granularity"], str) or r["granularity"] not in ("token", "channel"):
            raise ArtifactError(f"{where}.{side}.granularity: expected one of ['token', 'channel'], "
                                f"got {_got(r['granularity'])}")
        json_int(r["bits"], f"{where}.{side}.bits", 2, 2)
        _bool(r["codebook"], f"{where}.{side}.codebook")
    json_int(d["num_kv_heads"], f"{where}.num_kv_heads", 1, L.max_kv_heads)
    json_int(d["head_dim"], f"{where}.head_dim", L.min_head_dim, L.max_head_dim)
    json_int(d["sink"], f"{where}.sink", 0, L.max_sink)
    json_int(d["window"], f"{where}.window", 0, L.max_window)
    json_int(d["page_size"], f"{where}.page_size", L.min_page_size, L.max_page_size)
    try:
        return KVCacheLayout.from_dict(d)
    except (TypeError, KeyError, ValueError, NotImplementedError) as e:
        raise ArtifactError(f"{where}: {printable(e)}") from None


def parse_fingerprint(x: Any, where: str = "fingerprint") -> dict[str, Any]:
    """A fingerprint from untrusted JSON: required keys, JSON types and :data:`LIMITS` checked."""
    L = LIMITS
    fp = _dict(x, where)
    _keys(fp, where, FINGERPRINT_KEYS)
    _str(fp["model_type"], f"{where}.model_type")
    for key in ("architecture", "name"):
        if key in fp:
            _str(fp[key], f"{where}.{key}", limit=4096, optional=True)
    json_int(fp["num_hidden_layers"], f"{where}.num_hidden_layers", 1, L.max_layers)
    json_int(fp["num_key_value_heads"], f"{where}.num_key_value_heads", 1, L.max_kv_heads)
    heads = json_int(fp["num_attention_heads"], f"{where}.num_attention_heads", 1, L.max_heads)
    if heads % fp["num_key_value_heads"]:
        raise ArtifactError(f"{where}.num_attention_heads: expected a multiple of num_key_value_heads = "
                            f"{fp['num_key_value_heads']}, got {heads}")
    json_int(fp["head_dim"], f"{where}.head_dim", 1, L.max_head_dim)
    json_int(fp["hidden_size"], f"{where}.hidden_size", 1, L.max_hidden_size)
    json_int(fp["vocab_size"], f"{where}.vocab_size", 0, L.max_vocab_size)
    _dict(fp["rope"], f"{where}.rope", optional=True)
    return fp


def _artifact_file(d: Path, name: str) -> tuple[Path, os.stat_result, Any]:
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


def _read_meta(d: Path) -> dict[str, Any]:
    path, st, f = _artifact_file(d, META_FILE)
    where = printable(path)
    with f:
        if st.st_size > LIMITS.max_meta_bytes:
            raise ArtifactError(f"{where}: expected at most {LIMITS.max_meta_bytes:,} bytes, got {st.st_size:,}")
        raw = f.read(st.st_size + 1)  # read(n) allocates n bytes up front: n is the checked size
    if len(raw) > st.st_size:
        raise ArtifactError(f"{where}: expected at most {LIMITS.max_meta_bytes:,} bytes, got more")
    meta = parse_json(raw, where)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        got = _got(meta.get("format")) if isinstance(meta, dict) else _kind(meta)
        raise ArtifactError(f"{where}: expected format {FORMAT_NAME!r}, got {got}")
    version = meta.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise ArtifactError(f"{where}: unsupported format_version {_got(version)} (this build reads {FORMAT_VERSION})")
    for key in REQUIRED_META_KEYS:
        if key not in meta:
            raise ArtifactError(f"{where}: missing key {key!r}")
    json_int(meta["num_layers"], f"{where}: num_layers", 1, LIMITS.max_layers)
    _bool(meta["values_prerotated"], f"{where}: values_prerotated")
    sha = meta["tensor_sha256"]
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ArtifactError(f"{where}: tensor_sha256: expected 64 hex digits, got {_got(sha)}")
    if meta.get("tensor_file", TENSOR_FILE) != TENSOR_FILE:
        raise ArtifactError(f"{where}: tensor_file: expected {TENSOR_FILE!r}, got {_got(meta['tensor_file'])}")
    for key in ("config", "stats"):
        if key in meta:
            _dict(meta[key], f"{where}: {key}")
    return meta


def _layer_shapes(h: int, d: int) -> dict[str, tuple[int, ...]]:
    """``{field: shape}`` of one layer's tensors (the module doc's table)."""
    return {name: (h, d, d) if name.endswith("rotation") else (h, 4) if name.endswith("levels") else
            (h,) if name.endswith("clip") else (h, d) for name in TENSOR_FIELDS}


def _read_tensor_file(d: Path, meta: dict[str, Any], layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """The tensors of ``rotations.safetensors``, with every size bounded before it is read.

    The file size is checked against what the layout implies, the file is read in chunks (hashed as it
    streams) into one buffer of that size, the checksum compared, and only then is the header parsed (its
    length bounded; names, dtypes, shapes and offsets checked) and the tensors made from the buffer.
    """
    tpath, st, f = _artifact_file(d, TENSOR_FILE)
    with f:
        return _read_tensor_stream(f, st, tpath, meta, layout)


def _read_tensor_stream(f, st: os.stat_result, tpath: Path, meta: dict[str, Any],
                        layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """:func:`_read_tensor_file` on the opened file ``f`` (``st``: its ``fstat``)."""
    where = printable(tpath)
    n, h, dd = meta["num_layers"], layout.num_kv_heads, layout.head_dim
    shapes = _layer_shapes(h, dd)
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
        raise unreadable(f"header: expected a JSON object, got {_kind(header)}")
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
            raise unreadable(f"{name}: expected {{dtype, shape, data_offsets}}, got {_kind(e)}")
        if e["dtype"] != "F32":
            raise ArtifactError(f"{name}: expected float32 (F32), got {_got(e['dtype'])}")
        s = e["shape"]
        if not isinstance(s, list) or len(s) > 8 or not all(type(v) is int for v in s) or tuple(s) != shape:
            got = tuple(s) if isinstance(s, list) and len(s) <= 8 else _got(s)
            raise ArtifactError(f"{name}: expected {list(shape)}, got {got}")
        off = e["data_offsets"]
        nbytes = 4 * math.prod(shape)
        if (not isinstance(off, list) or len(off) != 2 or not all(type(v) is int for v in off)
                or not 0 <= off[0] <= off[1] <= data_len or off[1] - off[0] != nbytes):
            raise unreadable(f"{name}: data_offsets {_got(off) if not isinstance(off, list) else off[:2]} do not "
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


def load_artifact(directory: str | Path, model_config: Any = None) -> OscarArtifact:
    """Read and validate an artifact directory; with ``model_config`` also check it matches that model.

    Raises :class:`ArtifactMissing` (also a ``FileNotFoundError``) for a missing file and :class:`ArtifactError`
    (a ``ValueError``; one message naming the problem) for anything else: sizes and counts beyond
    :data:`LIMITS`, JSON types, symlinks leaving the directory, format/version, checksum (truncated or edited
    tensor file), tensor names, shapes, dtypes, finiteness, ranges, orthogonality, clip ratios, scalings,
    levels, fingerprint. Work and memory are bounded by the limits before anything from the files is trusted.
    """
    d = Path(directory)
    meta = _read_meta(d)
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
    tensors = _read_tensor_file(d, meta, layout)
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


def transforms_from_rotations(
    k_rotations: Sequence[torch.Tensor], v_rotations: Sequence[torch.Tensor], k_clip: float = 1.0, v_clip: float = 1.0
) -> list[LayerTransform]:
    """Plain rotation-only transforms (``[H_kv, D, D]`` per layer; fp64 inputs are cast to fp32)."""
    out = []
    for rk, rv in zip(k_rotations, v_rotations):
        base = LayerTransform.identity(rk.shape[0], rk.shape[-1], k_clip, v_clip)
        out.append(replace(base, k_rotation=rk.float().contiguous(), v_rotation=rv.float().contiguous()))
    return out


__all__ = [
    "LIMITS",
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
    "transforms_from_rotations",
    "validate",
    "write_files",
]
