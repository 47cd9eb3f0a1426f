"""Orthogonal rotations and per-coordinate scalings from calibration targets (docs/design.md §4 "Rotation").

Everything here is fp64 and per KV head: a target is ``[H_kv, D, D]`` (symmetric PSD), a rotation
``[H_kv, D, D]`` applied as ``x_rot = x @ R``. Kinds:

    "identity"   R = I
    "hadamard"   R = H_G, the normalised Hadamard of size G repeated along the diagonal (G = D: one block)
    "random"     a seeded random orthogonal matrix (QR of a Gaussian; a data-free control)
    "eig"        R = U, eigenvectors of the target sorted by descending eigenvalue (no mixing)
    "oscar"      R = U[:, perm] @ H_G: eigenvectors, then the Hadamard. When G < D, ``perm`` is the
                 bit-reversal of the eigenvalue order, so every G-block receives an even share of the
                 large directions (for G = D the permutation is the identity, the Hadamard mixes all).

head_dim must be a power of two for the Hadamard kinds (``NotImplementedError`` otherwise; "eig",
"identity" and "random" work for any D).

Scalings ``d`` (``k' = k R diag(d)``, ``q' = q R diag(1/d)``): with one (scale, lo) per row and no mixing
after the scaling, the row's range is set by its largest coordinate; :func:`whitening_scale` equalises the
coordinates' spread (``d_i ∝ 1/sqrt(E[k_i^2])`` in the rotated basis, geometric mean 1), which with the
eigenbasis of ``C_Q`` turns the score error from ``tr(C_Q) max_i E[k_i^2]`` into ``sum_i λ_i E[k_i^2]``.
"""

from __future__ import annotations

import torch

from oscar_export.kernels.transform import hadamard

ROTATION_KINDS = ("identity", "hadamard", "random", "eig", "oscar")


def bit_reversal(n: int) -> torch.Tensor:
    """``[n]`` long: position ``i`` holds ``i`` with its ``log2 n`` bits reversed (n a power of two)."""
    if n <= 0 or n & (n - 1):
        raise NotImplementedError(f"bit_reversal: n must be a power of two, got {n}")
    bits = n.bit_length() - 1
    return torch.tensor([int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(n)], dtype=torch.long)


def block_hadamard(d: int, group: int) -> torch.Tensor:
    """``[d, d]`` fp64 block-diagonal normalised Hadamard with ``d // group`` blocks of ``group``."""
    if d % group:
        raise ValueError(f"block_hadamard: group {group} must divide head_dim {d}")
    return torch.block_diag(*([hadamard(group)] * (d // group)))


def eigenbasis(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U [H, D, D], λ [H, D])`` of symmetric ``target [H, D, D]``, eigenvalues descending, fp64."""
    t = target.double()
    t = (t + t.transpose(-1, -2)) * 0.5
    lam, u = torch.linalg.eigh(t)
    return u.flip(-1), lam.flip(-1)


def random_orthogonal(num_heads: int, d: int, seed: int) -> torch.Tensor:
    """``[H, D, D]`` fp64 Haar-random orthogonal matrices (sign-fixed QR), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(num_heads, d, d, generator=g, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    return qm * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def rotation(kind: str, target: torch.Tensor | None, group: int, seed: int = 0) -> torch.Tensor:
    """``[H, D, D]`` fp64 rotation of ``kind`` (see module doc). ``target [H, D, D]`` is needed by eig/oscar."""
    if kind not in ROTATION_KINDS:
        raise ValueError(f"rotation kind: expected one of {ROTATION_KINDS}, got {kind!r}")
    if target is None:
        raise ValueError("rotation: a target [H, D, D] is needed (for its shape, and by 'eig'/'oscar')")
    h, d = target.shape[0], target.shape[-1]
    if kind == "identity":
        return torch.eye(d, dtype=torch.float64).expand(h, d, d).clone()
    if kind == "hadamard":
        return block_hadamard(d, group).expand(h, d, d).clone()
    if kind == "random":
        return random_orthogonal(h, d, seed)
    u, _ = eigenbasis(target)
    if kind == "eig":
        return u
    hb = block_hadamard(d, group)
    if group < d:
        u = u[..., bit_reversal(d)]
    return u @ hb


def orthogonality_error(r: torch.Tensor) -> float:
    """``max |R^T R - I|`` in fp64."""
    r = r.double()
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return float((r.transpose(-1, -2) @ r - eye).abs().max())


def rotated_second_moment(c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Diagonal of ``R^T C R``: ``[H, D]`` energy per rotated coordinate."""
    return torch.einsum("hij,hjk,hki->hi", r.transpose(-1, -2).double(), c.double(), r.double())


def whitening_scale(second_moment: torch.Tensor, r: torch.Tensor, floor: float = 1e-3) -> torch.Tensor:
    """``d [H, D]`` fp64: ``1/sqrt`` of each rotated coordinate's energy, geometric mean 1.

    Coordinates with less than ``floor`` x the mean energy are treated as having ``floor`` x the mean (no
    blow-up of dead directions).
    """
    e = rotated_second_moment(second_moment, r).clamp_min(0)
    e = torch.maximum(e, floor * e.mean(-1, keepdim=True)).clamp_min(1e-30)
    d = e.rsqrt()
    return d / d.log().mean(-1, keepdim=True).exp()


__all__ = [
    "ROTATION_KINDS",
    "bit_reversal",
    "block_hadamard",
    "eigenbasis",
    "orthogonality_error",
    "random_orthogonal",
    "rotated_second_moment",
    "rotation",
    "whitening_scale",
]
