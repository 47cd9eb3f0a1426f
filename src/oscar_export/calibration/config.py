"""What decides a calibration: :class:`CalibrationConfig`, validated on construction and recorded in the artifact."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from oscar_export.kernels.layout import PACKINGS, KVCacheLayout

from .covariance import VALUE_WEIGHTINGS
from .key_bits import DEFAULT_BUDGET, MIN_SEQ_LEN
from .key_bits import METRICS as KEY_BITS_METRICS
from .rotation import ROTATION_KINDS


@dataclass(frozen=True)
class CalibrationConfig:
    """Everything that decides the artifact (recorded in it).

    Args:
        tokens: total calibration tokens (statistics + held-out).
        seq_len: tokens per calibration sequence (>= sink + window + page_size for the window-aware objective).
        heldout: sequences set aside to fit clips and choose candidates (not in the statistics).
        batch_size: sequences per forward.
        per_head: per-KV-head rotations and clips (False: one per layer, shared by the KV heads).
        rotation: ``"auto"`` (best held-out candidate per head) or one kind of ``rotation.ROTATION_KINDS``.
        scale: ``"auto"`` (candidates decide), ``"none"`` or ``"whiten"`` (with a fixed rotation).
        clip: ``"fitted"`` (grid search), ``"global"`` (K 0.96 / V 0.92) or ``"none"``.
        key_granularity: ``"token"`` or ``"channel"`` (per channel within a page).
        value_weighting: value target, one of ``covariance.VALUE_WEIGHTINGS``.
        key_mean, value_mean: remove the mean in the stored basis (exact).
        codebook: ``"auto"`` (kept where it lowers the error), ``"off"`` or ``"on"``.
        sink, window, page_size: cache layout (docs/design.md §3.2).
        data: sources (``"pydoc"``, ``"generate"``, file paths).
        seed: data sampling and random rotations.
        key_bits_budget: None (every layer 2-bit keys) or the average page bits per element (K and V, over the
            paged layers) within which layers get 4-bit keys (``key_bits.py``; e.g. 3.0); needs ``seq_len >
            sink + window + page_size`` so the held-out queries read pages.
        key_bits_metric: what the 4-bit keys must reduce, one of ``key_bits.METRICS`` (``"kl"``, ``"top"``).
    """

    tokens: int = 20_000
    seq_len: int = 512
    heldout: int = 4
    batch_size: int = 4
    per_head: bool = True
    rotation: str = "auto"
    scale: str = "auto"
    clip: str = "fitted"
    key_granularity: str = "channel"
    value_weighting: str = "prob"
    key_mean: bool = True
    value_mean: bool = True
    codebook: str = "off"
    sink: int = 64
    window: int = 256
    page_size: int = 64
    data: tuple[str, ...] = ("pydoc",)
    seed: int = 0
    key_bits_budget: float | None = None
    key_bits_metric: str = "kl"
    packing: str = "linear"

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", tuple(self.data))
        choices = {
            "rotation": ("auto", *ROTATION_KINDS), "scale": ("auto", "none", "whiten"),
            "clip": ("fitted", "global", "none"), "key_granularity": ("token", "channel"),
            "value_weighting": VALUE_WEIGHTINGS, "codebook": ("auto", "off", "on"),
            "key_bits_metric": KEY_BITS_METRICS, "packing": PACKINGS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"CalibrationConfig.{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        if self.rotation == "auto" and self.scale == "whiten":
            raise ValueError("CalibrationConfig: scale='whiten' needs a fixed rotation (auto chooses the scale)")
        if self.seq_len < self.sink + self.page_size:
            raise ValueError(
                f"CalibrationConfig.seq_len: expected >= sink + page_size = {self.sink + self.page_size}, "
                f"got {self.seq_len}"
            )
        if self.key_bits_budget is not None:
            b = self.key_bits_budget
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < float("inf"):
                raise ValueError(f"CalibrationConfig.key_bits_budget: expected None or bits per element > 0, got {b!r}")
            if self.seq_len <= self.sink + self.window + self.page_size:
                raise ValueError(
                    f"CalibrationConfig.key_bits_budget: the held-out queries read no page unless seq_len > sink + "
                    f"window + page_size = {self.sink + self.window + self.page_size}, got {self.seq_len}"
                )
        if self.heldout < 1 or self.batch_size < 1:
            raise ValueError(f"CalibrationConfig: heldout and batch_size must be >= 1, "
                             f"got {self.heldout}, {self.batch_size}")
        if self.num_sequences <= self.heldout:
            raise ValueError(
                f"CalibrationConfig.tokens: {self.tokens} tokens make {self.num_sequences} sequences of "
                f"{self.seq_len}; need more than the {self.heldout} held-out ones"
            )

    @property
    def num_sequences(self) -> int:
        return self.tokens // self.seq_len

    @property
    def objective_window(self) -> int:
        """BF16 window the objective honours (0 when sequences are too short to reach past it)."""
        return self.window if self.seq_len >= self.sink + self.window + self.page_size else 0

    def layout(self, num_kv_heads: int, head_dim: int, codebook_k: bool = False,
               codebook_v: bool = False) -> KVCacheLayout:
        base = KVCacheLayout.default(
            num_kv_heads, head_dim, self.key_granularity, sink=self.sink, window=self.window, page_size=self.page_size,
            packing=self.packing
        )
        return replace(base, key=replace(base.key, codebook=codebook_k), value=replace(base.value, codebook=codebook_v))

    @classmethod
    def recipe(cls, **kw) -> "CalibrationConfig":
        """The default of ``oscar-export calibrate``: 4-bit keys within ``key_bits.DEFAULT_BUDGET`` page bits, chosen
        on held-out sequences of ``key_bits.MIN_SEQ_LEN`` tokens (docs/evaluation.md); ``kw`` overrides."""
        return cls(**{"seq_len": MIN_SEQ_LEN, "key_bits_budget": DEFAULT_BUDGET, **kw})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CalibrationConfig":
        return cls(**d)


__all__ = ["CalibrationConfig"]
