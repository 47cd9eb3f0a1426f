"""The OSCAR artifact: what calibration produces and everything downstream reads (DESIGN §3.3).

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

No pickle anywhere: JSON and safetensors only, so loading an artifact from a stranger runs no code.
:func:`load_artifact` validates everything and raises one ``ValueError`` naming what is wrong.
Rotations are stored in fp32; orthogonality is checked in fp64 as ``max |R^T R - I| <= ORTHO_TOL``
(``1e-5``: fp32 rounding of an exactly orthogonal ``D <= 256`` matrix stays below ~1e-6).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from oscar_export.kernels.layout import UNIFORM_LEVELS, KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

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
    """

    layout: KVCacheLayout
    transforms: tuple[LayerTransform, ...]
    fingerprint: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "transforms", tuple(self.transforms))
        validate(self)

    @property
    def num_layers(self) -> int:
        return len(self.transforms)

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
        """Raise ``ValueError`` unless ``config`` (a HF config or model) is the model this was calibrated for."""
        bad = fingerprint_mismatches(self.fingerprint, model_fingerprint(config))
        if bad:
            raise ValueError(
                f"OSCAR artifact does not match this model ({self.fingerprint.get('name')!r} "
                f"{self.fingerprint.get('model_type')} calibrated): " + "; ".join(bad)
            )

    def with_values_prerotated(self, flag: bool = True) -> "OscarArtifact":
        """The same artifact for a checkpoint whose ``v_proj``/``o_proj`` already fold ``R_V``/``d_V``."""
        return replace(self, transforms=tuple(replace(t, values_prerotated=flag) for t in self.transforms))

    def bits_per_element(self, length: int | None = None) -> float:
        """INT2 history bits per K/V element, or of a whole ``length``-token sequence with the BF16 windows."""
        if length is None:
            return self.layout.int2_bits_per_element()
        return self.layout.effective_bits_per_element(length)

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
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "num_layers": self.num_layers,
            "values_prerotated": prerot.pop() if len(prerot) == 1 else None,
            "fingerprint": _jsonable(self.fingerprint),
            "layout": self.layout.to_dict(),
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


def write_files(directory: str | Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Low-level writer: the tensor file, then ``meta`` with its sha256 filled in (tests tamper through it)."""
    from safetensors.torch import save

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    blob = save(tensors, metadata={"format": FORMAT_NAME})
    (d / TENSOR_FILE).write_bytes(blob)
    meta = dict(meta, tensor_sha256=hashlib.sha256(blob).hexdigest())
    (d / META_FILE).write_text(json.dumps(meta, indent=1, allow_nan=False) + "\n")
    return d


# ---- validation ----------------------------------------------------------------------------------------------


def _check_transform(i: int, t: LayerTransform, layout: KVCacheLayout) -> None:
    where = f"layers.{i}"
    if (t.num_kv_heads, t.head_dim) != (layout.num_kv_heads, layout.head_dim):
        raise ValueError(
            f"{where}: expected {layout.num_kv_heads} KV heads x head_dim {layout.head_dim}, "
            f"got {t.num_kv_heads} x {t.head_dim}"
        )
    for name in TENSOR_FIELDS:
        x = getattr(t, name)
        if not bool(torch.isfinite(x).all()):
            n = int((~torch.isfinite(x)).sum())
            raise ValueError(f"{where}.{name}: {n} non-finite values (NaN/Inf)")
    eye = torch.eye(t.head_dim, dtype=torch.float64)
    for name in ("k_rotation", "v_rotation"):
        r = getattr(t, name).double()
        err = (r.transpose(-1, -2) @ r - eye).abs().amax(dim=(-1, -2))  # [H_kv]
        if bool((err > ORTHO_TOL).any()):
            h = int(err.argmax())
            raise ValueError(
                f"{where}.{name}: not orthogonal: max |R^T R - I| = {float(err[h]):.3g} at KV head {h} "
                f"(tolerance {ORTHO_TOL:g}, fp64)"
            )
    for name, fmt in (("k_levels", layout.key), ("v_levels", layout.value)):
        lv = getattr(t, name).double()
        if bool((lv < 0).any() or (lv > 3).any()) or bool((lv[:, 1:] <= lv[:, :-1]).any()):
            raise ValueError(f"{where}.{name}: levels must be strictly ascending in [0, 3], got {lv.tolist()}")
        uniform = bool(torch.equal(getattr(t, name), torch.tensor(UNIFORM_LEVELS).expand_as(lv)))
        if not fmt.codebook and not uniform:
            raise ValueError(
                f"{where}.{name}: non-uniform levels {lv.tolist()} but the layout's row format has codebook=False"
            )


def validate(art: OscarArtifact) -> None:
    """Everything :func:`load_artifact` checks beyond file integrity; raises ``ValueError``."""
    fp = art.fingerprint
    missing = [k for k in FINGERPRINT_KEYS if k not in fp]
    if missing:
        raise ValueError(f"fingerprint: missing keys {missing}")
    if art.num_layers != fp["num_hidden_layers"]:
        raise ValueError(
            f"transforms: expected one per layer ({fp['num_hidden_layers']} layers in the fingerprint), "
            f"got {art.num_layers}"
        )
    if (art.layout.num_kv_heads, art.layout.head_dim) != (fp["num_key_value_heads"], fp["head_dim"]):
        raise ValueError(
            f"layout: expected {fp['num_key_value_heads']} KV heads x head_dim {fp['head_dim']} (fingerprint), "
            f"got {art.layout.num_kv_heads} x {art.layout.head_dim}"
        )
    for i, t in enumerate(art.transforms):
        _check_transform(i, t, art.layout)


def _read_meta(d: Path) -> dict[str, Any]:
    path = d / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"not an OSCAR artifact: {path} is missing")
    try:
        meta = json.loads(path.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: expected format {FORMAT_NAME!r}, got {meta.get('format') if isinstance(meta, dict) else meta!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: unsupported format_version {meta.get('format_version')!r} (this build reads {FORMAT_VERSION})"
        )
    for key in ("num_layers", "fingerprint", "layout", "tensor_sha256", "values_prerotated"):
        if key not in meta:
            raise ValueError(f"{path}: missing key {key!r}")
    return meta


def load_artifact(directory: str | Path, model_config: Any = None) -> OscarArtifact:
    """Read and validate an artifact directory; with ``model_config`` also check it matches that model.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` (one message naming the problem) for
    anything else: format/version, checksum (truncated or edited tensor file), tensor names, shapes,
    dtypes, finiteness, orthogonality, clip ratios, scalings, levels, fingerprint.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    d = Path(directory)
    meta = _read_meta(d)
    tpath = d / TENSOR_FILE
    if not tpath.is_file():
        raise FileNotFoundError(f"not an OSCAR artifact: {tpath} is missing")
    blob = tpath.read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    if sha != meta["tensor_sha256"]:
        raise ValueError(
            f"{tpath}: checksum mismatch (file truncated or modified): expected sha256 {meta['tensor_sha256']}, "
            f"got {sha} ({len(blob)} bytes)"
        )
    try:
        tensors = load(blob)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ValueError(f"{tpath}: unreadable safetensors file ({e})") from None
    try:
        layout = KVCacheLayout.from_dict(meta["layout"])
    except (TypeError, KeyError, ValueError, NotImplementedError) as e:
        raise ValueError(f"{d / META_FILE}: invalid layout ({e})") from None
    fp = meta["fingerprint"]
    if not isinstance(fp, dict) or (layout.num_kv_heads, layout.head_dim) != (
        fp.get("num_key_value_heads"), fp.get("head_dim")
    ):
        got = (fp.get("num_key_value_heads"), fp.get("head_dim")) if isinstance(fp, dict) else fp
        raise ValueError(
            f"{d / META_FILE}: layout has {layout.num_kv_heads} KV heads x head_dim {layout.head_dim}, "
            f"the fingerprint {got}"
        )
    n = meta["num_layers"]
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"{d / META_FILE}: num_layers: expected a positive int, got {n!r}")
    expected = {f"layers.{i}.{name}" for i in range(n) for name in TENSOR_FIELDS}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(
            f"{tpath}: tensor names do not match {n} layers: missing {missing[:4]}{'...' if len(missing) > 4 else ''}"
            f", unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}"
        )
    prerot = bool(meta["values_prerotated"])
    transforms = []
    for i in range(n):
        kw = {name: tensors[f"layers.{i}.{name}"] for name in TENSOR_FIELDS}
        h, dd = layout.num_kv_heads, layout.head_dim
        for name, t in kw.items():
            shape = (h, dd, dd) if name.endswith("rotation") else (h, 4) if name.endswith("levels") else (
                (h,) if name.endswith("clip") else (h, dd))
            if tuple(t.shape) != shape:
                raise ValueError(f"layers.{i}.{name}: expected {list(shape)}, got {tuple(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"layers.{i}.{name}: {int((~torch.isfinite(t)).sum())} non-finite values (NaN/Inf)")
        try:
            transforms.append(LayerTransform(**kw, values_prerotated=prerot))
        except ValueError as e:
            raise ValueError(f"layers.{i}: {e}") from None
    art = OscarArtifact(
        layout, tuple(transforms), meta["fingerprint"], meta.get("config") or {}, meta.get("stats") or {}
    )
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
    "FORMAT_VERSION",
    "ORTHO_TOL",
    "OscarArtifact",
    "fingerprint_mismatches",
    "load_artifact",
    "model_fingerprint",
    "transforms_from_rotations",
    "validate",
    "write_files",
]
