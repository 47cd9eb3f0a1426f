"""Capture Q, K, V exactly as attention receives them, through transformers' ``AttentionInterface``.

The registered function ``"oscar_capture"`` sees post-RoPE (and post q/k-norm) tensors of every layer,
hands them to the :class:`Collector` passed down the forward call as the keyword ``oscar_collector``
(transformers forwards extra keyword arguments to the attention function, so nothing global is mutated
beyond the one registration), then computes the real output with the stock ``sdpa`` implementation.

The collector either accumulates float64 statistics (:class:`covariance.LayerStats`, bounded memory) or,
for the held-out sequences, keeps the fp32 tensors on the CPU (bounded by the held-out budget). NaN/Inf in
any captured tensor raises ``ValueError`` naming the layer (checked on the per-batch sums, which any
non-finite element poisons, so the check costs nothing).
Models sharded with ``device_map="auto"`` work: each layer's float64 statistics are accumulated on that layer's
device and moved to the CPU once, when the layer is fitted (``pipeline``); held-out tensors go to the CPU as
they are captured. Checked on the CPU through accelerate's hooks (``tests/calibration/test_pipeline.py``); a
run over several GPUs is untested here (``benchmarks/calibrate_tp.py`` measures one).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from .covariance import LayerStats, NonFiniteActivations
from .families import family_for

CAPTURE_NAME = "oscar_capture"


def capture_attention(module, query, key, value, attention_mask, *args, oscar_collector=None, **kwargs):
    """``AttentionInterface`` function: observe, then delegate to the stock sdpa attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if oscar_collector is not None:
        oscar_collector.observe(module, query, key, value, kwargs.get("scaling"))
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, *args, **kwargs)


def register() -> None:
    """Register ``"oscar_capture"`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_NAME, capture_attention)


@dataclass
class HeldOut:
    """fp32 CPU tensors of the held-out sequences of one layer: q ``[N, H, T, D]``, k, v ``[N, H_kv, T, D]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float


@dataclass
class Collector:
    """Receives every layer's Q, K, V. ``mode`` is ``"stats"`` or ``"heldout"``.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (checked on every call).
        skip: positions ``< skip`` are left out of the statistics (the BF16 sink).
        mode: ``"stats"`` (stream statistics) or ``"heldout"`` (keep the tensors).
        weightings: value weightings to accumulate (``covariance.VALUE_WEIGHTINGS``).
        model_scaling: the family table's softmax scale (``families.ModelAttention.scaling``), used when
            transformers passes none and checked against the one it passes; None: ``head_dim ** -0.5``
            where none is passed, no check. :meth:`for_model` fills all of these from the table.
        sliding_layers: layers with a sliding window (Gemma 3's local layers): not observed. They keep their
            window at full precision in the serving cache, so the artifact gives them identity transforms.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    skip: int
    mode: str = "stats"
    weightings: tuple[str, ...] = ("prob", "research")
    stats: list[LayerStats | None] = field(default_factory=list)
    heldout: list[list[tuple[torch.Tensor, ...]]] = field(default_factory=list)
    scaling: list[float | None] = field(default_factory=list)
    model_scaling: float | None = None
    sliding_layers: tuple[int, ...] = ()

    @classmethod
    def for_model(cls, model, skip: int, **kw) -> Collector:
        """A collector shaped by the family table for ``model`` (raises its ``NotImplementedError``)."""
        f = family_for(model)
        return cls(f.num_layers, f.num_kv_heads, f.head_dim, skip, model_scaling=f.scaling,
                   sliding_layers=f.sliding_layers, **kw)

    def __post_init__(self) -> None:
        self.stats = [None] * self.num_layers
        self.heldout = [[] for _ in range(self.num_layers)]
        self.scaling = [None] * self.num_layers

    @torch.no_grad()
    def observe(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> None:
        """``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]`` of layer ``module.layer_idx``."""
        i = int(module.layer_idx)
        if not 0 <= i < self.num_layers:
            raise ValueError(f"capture: layer index {i} outside 0..{self.num_layers - 1}")
        if i in self.sliding_layers:
            return
        if k.shape[1] != self.num_kv_heads or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"capture layer {i}: expected keys [B, {self.num_kv_heads}, T, {self.head_dim}], got {tuple(k.shape)}"
            )
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"capture layer {i}: calibration runs without a cache "
                             f"(q {q.shape[2]} vs k {k.shape[2]} tokens)")
        s = self._scale(i, scaling)
        self.scaling[i] = s
        if self.mode == "heldout":
            for name, x in (("queries", q), ("keys", k), ("values", v)):
                if not bool(torch.isfinite(x.sum())):  # NaN/Inf propagate into the sum
                    _non_finite(i, name, x)
            self.heldout[i].append((q.float().cpu(), k.float().cpu(), v.float().cpu()))
            return
        if self.stats[i] is None:
            self.stats[i] = LayerStats(self.num_kv_heads, self.head_dim, k.device, self.weightings)
        try:
            self.stats[i].update(q, k, v, s, self.skip)
        except NonFiniteActivations as e:
            _non_finite(i, e.what, {"queries": q, "keys": k, "values": v}[e.what])

    def _scale(self, i: int, scaling: float | None) -> float:
        """The scale transformers passed (checked against the table's), else the table's rule."""
        if scaling is None:
            return self.model_scaling if self.model_scaling is not None else self.head_dim**-0.5
        s = float(scaling)
        if self.model_scaling is not None and abs(s - self.model_scaling) > 1e-6 * self.model_scaling:
            raise ValueError(
                f"capture layer {i}: the model's attention scale {s:.6g} is not the family table's "
                f"{self.model_scaling:.6g} (calibration/families.py would bake the wrong scale into the kernel bundle)"
            )
        return s

    def heldout_layer(self, i: int) -> HeldOut:
        parts = self.heldout[i]
        if not parts:
            raise ValueError(f"capture: no held-out sequences were recorded for layer {i}")
        q, k, v = (torch.cat([p[j] for p in parts]) for j in range(3))
        return HeldOut(q, k, v, self.scaling[i])


def _non_finite(layer: int, name: str, x: torch.Tensor) -> None:
    n = int((~torch.isfinite(x)).sum())
    raise ValueError(
        f"capture: layer {layer} produced {n} non-finite (NaN/Inf) {name}; calibration statistics would be "
        f"poisoned (check the model weights / dtype of layer {layer})"
    )


def base_model(model) -> torch.nn.Module:
    """The decoder stack without the LM head (the head's logits are not needed)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return base if isinstance(base, torch.nn.Module) else model


@contextmanager
def capturing(model) -> Iterator[None]:
    """Switch ``model`` to the capture attention, restoring its implementation afterwards."""
    register()
    old = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(old or "sdpa")


@torch.no_grad()
def run_batches(
    model, collector: Collector, batches: Iterable[torch.Tensor], progress: Callable[[int], None] | None = None
) -> None:
    """Forward ``[B, T]`` token batches through the decoder with the collector attached."""
    body = base_model(model)
    dev = next(model.parameters()).device
    with capturing(model):
        for ids in batches:
            body(input_ids=ids.to(dev), use_cache=False, oscar_collector=collector)
            if progress is not None:
                progress(ids.numel())


__all__ = ["CAPTURE_NAME", "Collector", "HeldOut", "base_model", "capture_attention", "capturing", "register",
           "run_batches"]
