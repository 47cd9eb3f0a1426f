"""What calibration gives one attention layer, as the tensors the cache ops read.

Stored keys and values live in a transformed basis (docs/design.md §4), per KV head ``h``::

    k_s = (k @ R_K[h]) * d_K[h] - mu_K[h]          q_s = (q @ R_K[h]) / d_K[h]      (q_s . k_s = q . k - const)
    v_s = (v @ R_V[h]) * d_V[h] - mu_V[h]          out = ((o_s + mu_V[h]) / d_V[h]) @ R_V[h]^T

Subtracting ``mu_K`` shifts every score of one query by the same amount (softmax-invariant); ``mu_V`` is
added back exactly because attention weights sum to 1. After export ``R_V`` and ``d_V`` are folded into
``v_proj``/``o_proj`` (``values_prerotated=True``): the model already emits ``v @ R_V * d_V``.
Clipping and codebooks apply to the stored rows; ``k_clip``/``v_clip`` are per-head clip ratios (the
fraction of a quantization group's ``|x|`` distribution kept, 1.0 = plain min-max).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .layout import UNIFORM_LEVELS


@dataclass(frozen=True)
class LayerTransform:
    """Per-layer, per-KV-head quantization transform. All tensors fp32.

    Args:
        k_rotation, v_rotation: ``[H_kv, D, D]`` orthogonal, applied as ``x @ R``.
        k_scale, v_scale: ``[H_kv, D]`` per-coordinate scalings ``d`` (> 0).
        k_mean, v_mean: ``[H_kv, D]`` means removed in the stored basis.
        k_clip, v_clip: ``[H_kv]`` clip ratios in (0, 1].
        k_levels, v_levels: ``[H_kv, 4]`` ascending code levels, ``0 <= l <= 3`` (uniform: 0, 1, 2, 3).
        values_prerotated: the model's values already carry ``R_V``/``d_V`` (exported checkpoint).
    """

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor
    k_levels: torch.Tensor
    v_levels: torch.Tensor
    values_prerotated: bool = False

    def __post_init__(self) -> None:
        h, d = self.k_rotation.shape[0], self.k_rotation.shape[-1]
        expect = {
            "k_rotation": (h, d, d), "v_rotation": (h, d, d), "k_scale": (h, d), "v_scale": (h, d),
            "k_mean": (h, d), "v_mean": (h, d), "k_clip": (h,), "v_clip": (h,), "k_levels": (h, 4),
            "v_levels": (h, 4),
        }
        for name, shape in expect.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"LayerTransform.{name}: expected {list(shape)}, got {got}")
            if t.dtype != torch.float32:
                raise ValueError(f"LayerTransform.{name}: expected float32, got {t.dtype}")
        for name in ("k_clip", "v_clip"):
            c = getattr(self, name)
            if not bool(((c > 0) & (c <= 1)).all()):
                raise ValueError(f"LayerTransform.{name}: clip ratios must be in (0, 1], got {c.tolist()}")
        for name in ("k_scale", "v_scale"):
            if not bool((getattr(self, name) > 0).all()):
                raise ValueError(f"LayerTransform.{name}: scalings must be > 0")

    @property
    def num_kv_heads(self) -> int:
        return self.k_rotation.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_rotation.shape[-1]

    @classmethod
    def identity(cls, num_kv_heads: int, head_dim: int, k_clip: float = 1.0, v_clip: float = 1.0) -> "LayerTransform":
        """No rotation, no scaling, no means, uniform levels: plain INT2 of the raw rows."""
        eye = torch.eye(head_dim).expand(num_kv_heads, head_dim, head_dim).contiguous()
        ones = torch.ones(num_kv_heads, head_dim)
        zeros = torch.zeros(num_kv_heads, head_dim)
        levels = torch.tensor(UNIFORM_LEVELS).expand(num_kv_heads, 4).contiguous()
        return cls(
            k_rotation=eye, v_rotation=eye.clone(), k_scale=ones, v_scale=ones.clone(), k_mean=zeros,
            v_mean=zeros.clone(), k_clip=torch.full((num_kv_heads,), float(k_clip)),
            v_clip=torch.full((num_kv_heads,), float(v_clip)), k_levels=levels, v_levels=levels.clone(),
        )

    def to(self, device: torch.device | str) -> "LayerTransform":
        fields = {n: getattr(self, n).to(device) for n in self.__dataclass_fields__ if n != "values_prerotated"}
        return replace(self, **fields)

    # ---- the basis change --------------------------------------------------------------------------------
    def transform_keys(self, k: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, T, D]`` post-RoPE keys -> stored basis (fp32)."""
        k = torch.matmul(k.float(), self.k_rotation.unsqueeze(0))
        return k * self.k_scale[None, :, None, :] - self.k_mean[None, :, None, :]

    def transform_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, D]`` post-RoPE queries -> stored key basis (fp32); H = H_kv * groups."""
        b, h, t, d = q.shape
        g = h // self.num_kv_heads
        q = q.float().reshape(b, self.num_kv_heads, g * t, d)
        q = torch.matmul(q, self.k_rotation.unsqueeze(0)) / self.k_scale[None, :, None, :]
        return q.view(b, h, t, d)

    def transform_values(self, v: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, T, D]`` values -> stored basis (fp32)."""
        v = v.float()
        if not self.values_prerotated:
            v = torch.matmul(v, self.v_rotation.unsqueeze(0)) * self.v_scale[None, :, None, :]
        return v - self.v_mean[None, :, None, :]

    def restore_output(self, o: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, D]`` attention output in the stored value basis -> model basis (fp32).

        With ``values_prerotated`` the output stays in the rotated basis (the exported ``o_proj`` undoes it).
        """
        b, h, t, d = o.shape
        g = h // self.num_kv_heads
        o = o.float().reshape(b, self.num_kv_heads, g * t, d) + self.v_mean[None, :, None, :]
        if not self.values_prerotated:
            o = torch.matmul(o / self.v_scale[None, :, None, :], self.v_rotation.transpose(-1, -2).unsqueeze(0))
        return o.view(b, h, t, d)


def clip_rank(ratio: torch.Tensor, group: int) -> torch.Tensor:
    """Index into the ascending ``|x|`` of a ``group``-element quantization group that sets the clip.

    ``ceil(ratio * group) - 1`` clamped to ``[0, group - 1]``; ratio 1 keeps the max (no clipping).
    """
    r = torch.ceil(ratio.double() * group).long() - 1
    return r.clamp(0, group - 1)


def hadamard(n: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix ``[n, n]`` fp64 (orthogonal); ``n`` a power of two."""
    if n <= 0 or n & (n - 1):
        raise NotImplementedError(f"hadamard: head_dim must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


__all__ = ["LayerTransform", "clip_rank", "hadamard"]
