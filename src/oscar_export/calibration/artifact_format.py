"""The OSCAR artifact's format on disk, its error types and the bounds a reader checks (docs/design.md §3.3).

A directory::

    oscar.json              format name + version, model fingerprint, cache layout (row formats, windows),
                            calibration config and statistics, sha256 of the tensor file
    rotations.safetensors   per layer i, per KV head (a shared rotation is stored once per head anyway):
                            layers.{i}.k_rotation  fp32 [H_kv, D, D]   (x_rot = x @ R)
                            layers.{i}.v_rotation  fp32 [H_kv, D, D]
                            layers.{i}.k_scale / v_scale    fp32 [H_kv, D]  (> 0)
                            layers.{i}.k_mean  / v_mean     fp32 [H_kv, D]
                            layers.{i}.k_clip  / v_clip     fp32 [H_kv]     (in (0, 1])
                            layers.{i}.k_levels / v_levels  fp32 [H_kv, 4]  (strictly ascending, in [0, 3])

``oscar.json`` may also hold ``key_bits``: one code width per layer (each in ``layout.CODE_BITS``: 4-bit keys
in the layers that need them). Absent means every layer stores 2-bit keys; the writer leaves it out unless a
layer has 4-bit keys. ``layout`` stays the base (2-bit) layout; layer ``i`` uses
``OscarArtifact.layer_layout(i) = layout.per_layer(key_bits)[i]``. Layers the model-family table
marks sliding (kept in BF16, never paged) must say 2.

No pickle anywhere: JSON and safetensors only, so loading an artifact from a stranger runs no code.
Rotations are stored in fp32; orthogonality is checked in fp64 as ``max |R^T R - I| <= ORTHO_TOL``
(``1e-5``: fp32 rounding of an exactly orthogonal ``D <= 256`` matrix stays below ~1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass

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
#: keys of one row format (``layout.key`` / ``layout.value``) in ``oscar.json``.
ROW_KEYS = ("head_dim", "group_size", "granularity", "bits", "codebook")
#: optional row-format keys: an artifact written before the field existed means its default ("linear").
ROW_OPTIONAL_KEYS = ("packing",)
LAYOUT_KEYS = ("num_kv_heads", "head_dim", "key", "value", "sink", "window", "page_size")
REQUIRED_META_KEYS = ("num_layers", "fingerprint", "layout", "tensor_sha256", "values_prerotated")

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
      (``tests/calibration/test_artifact_format.py::test_limits_keep_fp16_params_finite``); at ``d = 1`` the
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


def layer_shapes(h: int, d: int) -> dict[str, tuple[int, ...]]:
    """``{field: shape}`` of one layer's tensors (the module doc's table)."""
    return {name: (h, d, d) if name.endswith("rotation") else (h, 4) if name.endswith("levels") else
            (h,) if name.endswith("clip") else (h, d) for name in TENSOR_FIELDS}


__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "LAYOUT_KEYS", "LIMITS", "META_FILE", "ORTHO_TOL", "REQUIRED_META_KEYS",
    "ROW_KEYS", "ROW_OPTIONAL_KEYS", "TENSOR_FIELDS", "TENSOR_FILE", "ArtifactError", "ArtifactLimits",
    "ArtifactMissing", "layer_shapes",
]
