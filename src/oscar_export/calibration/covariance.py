"""Streaming float64 statistics of one attention layer, per KV head (docs/design.md §4 "Key/Value target").

For KV head ``h`` with query group ``g = H / H_kv`` (query heads ``h*g .. h*g+g-1`` read it, as in HF's
``repeat_kv``), over token positions ``t >= skip`` (the BF16 sink is never quantized, and the first
tokens' activations are atypical)::

    C_Q[h]   = E[q q^T]                    over positions and the g query heads      (key target)
    mu_K[h]  = E[k],   S_K[h] = E[k k^T]
    values, three weightings w_t (each accumulated as sum w v v^T, sum w v, sum w):
      "plain"     w_t = 1
      "prob"      w_t = sum_i sum_heads p_{i,t}: causal-softmax attention mass token t receives, estimated
                  from every ``query_stride``-th query position (the T x T softmax is the costliest part of
                  capture; a stride of 8 keeps it small next to the forward pass)
      "research"  w_t = k_t^T C_Q k_t / mean (the research code's mean-squared logit; C_Q is the running
                  estimate including the current batch, since a single streaming pass cannot know the final one)

Only the weightings asked for are accumulated ("plain" always). Memory is ``O(H_kv * D^2)`` per layer whatever the
number of tokens; the attention probabilities of one batch (``[B, H, T, T]``) are the largest temporary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VALUE_WEIGHTINGS = ("prob", "research", "plain")


class NonFiniteActivations(ValueError):
    """NaN/Inf reached the statistics; ``what`` names the tensor (queries, keys, values)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"non-finite (NaN/Inf) {what}")
        self.what = what


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H_kv, g*T, D]`` (query heads grouped under the KV head they read)."""
    b, h, t, d = q.shape
    return q.reshape(b, num_kv_heads, (h // num_kv_heads) * t, d)


def causal_probs(q: torch.Tensor, k: torch.Tensor, scaling: float, query_stride: int = 1) -> torch.Tensor:
    """Causal softmax attention probabilities, fp32.

    Args:
        q: ``[B, H, T, D]``; k: ``[B, H_kv, T, D]``.
        query_stride: keep query positions ``0, s, 2s, ...`` only.
    Returns:
        ``[B, H_kv, g, T / s, T]`` (query position, key position).
    """
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qpos = torch.arange(0, t, query_stride, device=q.device)
    qq = q[:, :, ::query_stride].float()
    s = torch.matmul(group_queries(qq, hkv), k.float().transpose(-1, -2)) * scaling
    s = s.view(b, hkv, h // hkv, len(qpos), t)
    future = qpos[:, None] < torch.arange(t, device=q.device)[None, :]
    s.masked_fill_(future, float("-inf"))
    return torch.softmax(s, dim=-1)


@dataclass
class _Moments:
    """sum w x x^T ``[H_kv, D, D]``, sum w x ``[H_kv, D]``, sum w ``[H_kv]`` (fp64)."""

    xx: torch.Tensor
    x: torch.Tensor
    w: torch.Tensor

    @classmethod
    def zeros(cls, h: int, d: int, device) -> "_Moments":
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(h, d, d), z(h, d), z(h))

    def add(self, x: torch.Tensor, w: torch.Tensor | None = None) -> None:
        """``x [H_kv, N, D]`` fp32 rows of one batch, ``w [H_kv, N]`` weights (None = 1).

        One batch's sums are formed in fp32 (BLAS, ~1e-6 relative over a few thousand rows) and added to the
        fp64 running sums, so the error does not grow with the number of batches.
        """
        ones = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
        xa = torch.cat([x, ones], -1)  # [H_kv, N, D+1]: one matmul gives sum x x^T, sum x and the count
        wa = xa if w is None else xa * w[..., None]
        s = (wa.transpose(-1, -2) @ xa).double()  # [H_kv, D+1, D+1]
        if not bool(torch.isfinite(s).all()):  # any NaN/Inf row poisons its x_i^2 diagonal term
            raise NonFiniteActivations("rows")
        self.xx += s[:, :-1, :-1]
        self.x += s[:, -1, :-1]
        self.w += s[:, -1, -1]

    def second(self) -> torch.Tensor:
        return self.xx / self.w[:, None, None]

    def mean(self) -> torch.Tensor:
        return self.x / self.w[:, None]

    def centered(self) -> torch.Tensor:
        mu = self.mean()
        return self.second() - mu[:, :, None] * mu[:, None, :]


class LayerStats:
    """Running sums of one layer (see module doc). Lives on the layer's device."""

    def __init__(
        self, num_kv_heads: int, head_dim: int, device, weightings=VALUE_WEIGHTINGS, query_stride: int = 8
    ) -> None:
        bad = set(weightings) - set(VALUE_WEIGHTINGS)
        if bad:
            raise ValueError(f"value weightings: expected a subset of {VALUE_WEIGHTINGS}, got {sorted(bad)}")
        if query_stride < 1:
            raise ValueError(f"query_stride: expected >= 1, got {query_stride}")
        self.num_kv_heads, self.head_dim, self.query_stride = num_kv_heads, head_dim, query_stride
        self.q = _Moments.zeros(num_kv_heads, head_dim, device)
        self.k = _Moments.zeros(num_kv_heads, head_dim, device)
        self.v = {w: _Moments.zeros(num_kv_heads, head_dim, device) for w in {"plain", *weightings}}
        self.tokens = 0

    @torch.no_grad()
    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, skip: int) -> None:
        """Add one batch.

        Args:
            q: ``[B, H, T, D]`` post-RoPE queries; k, v: ``[B, H_kv, T, D]`` post-RoPE keys, values
                (causal, unpadded: every row attends to all earlier positions).
            scaling: the softmax scale (``1/sqrt(D)`` for Llama).
            skip: positions ``< skip`` are left out of every statistic.
        """
        b, h, t, d = q.shape
        hkv = self.num_kv_heads
        if skip >= t:
            raise ValueError(f"LayerStats.update: skip={skip} leaves no positions of a {t}-token sequence")
        g = h // hkv
        rows = lambda x: x[:, :, skip:].float().transpose(0, 1).reshape(x.shape[1], -1, d)  # noqa: E731
        qs = q[:, :, skip:].float().reshape(b, hkv, g, t - skip, d).transpose(0, 1).reshape(hkv, -1, d)
        ks, vs = rows(k), rows(v)  # [H_kv, B*(T-skip), D]
        for name, x in (("queries", q), ("keys", k), ("values", v)):  # the skipped head of the sequence too
            if skip and not bool(torch.isfinite(x[:, :, :skip].sum())):
                raise NonFiniteActivations(name)
        for name, m, x in (("queries", self.q, qs), ("keys", self.k, ks), ("values", self.v["plain"], vs)):
            try:  # checked on the small per-batch sums, not element by element (that would cost more)
                m.add(x)
            except NonFiniteActivations:
                raise NonFiniteActivations(name) from None
        if "prob" in self.v:
            mass = causal_probs(q, k, scaling, self.query_stride).sum(dim=(2, 3))[:, :, skip:]  # [B, H_kv, T-skip]
            self.v["prob"].add(vs, mass.transpose(0, 1).reshape(hkv, -1))
        if "research" in self.v:
            wr = (torch.matmul(ks, self.q.second().float()) * ks).sum(-1)  # k^T C_Q k, running C_Q, [H_kv, N]
            self.v["research"].add(vs, wr / wr.mean(dim=1, keepdim=True).clamp_min(1e-30))
        self.tokens += b * (t - skip)

    def to(self, device) -> "LayerStats":
        """Move the sums (e.g. to the CPU for fitting, whatever device the layer ran on)."""
        for m in (self.q, self.k, *self.v.values()):
            m.xx, m.x, m.w = m.xx.to(device), m.x.to(device), m.w.to(device)
        return self

    # ---- targets -----------------------------------------------------------------------------------------
    def key_target(self) -> torch.Tensor:
        """``C_Q = E[q q^T]`` ``[H_kv, D, D]`` fp64."""
        return self.q.second()

    def key_mean(self) -> torch.Tensor:
        return self.k.mean()

    def key_second(self, centered: bool) -> torch.Tensor:
        return self.k.centered() if centered else self.k.second()

    def value_target(self, weighting: str, centered: bool = False) -> torch.Tensor:
        """Weighted ``E_w[v v^T]`` ``[H_kv, D, D]`` (centered on the weighted mean if asked)."""
        if weighting not in self.v:
            raise ValueError(f"value weighting: expected one of {sorted(self.v)} (accumulated), got {weighting!r}")
        m = self.v[weighting]
        return m.centered() if centered else m.second()

    def value_mean(self, weighting: str = "plain") -> torch.Tensor:
        return self.v[weighting].mean()


def shared_target(c: torch.Tensor) -> torch.Tensor:
    """A per-layer target from per-head ones: the mean over KV heads, broadcast back ``[H_kv, D, D]``."""
    return c.mean(0, keepdim=True).expand_as(c).contiguous()


__all__ = ["VALUE_WEIGHTINGS", "LayerStats", "NonFiniteActivations", "causal_probs", "group_queries", "shared_target"]
