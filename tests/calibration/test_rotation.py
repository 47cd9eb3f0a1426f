"""``calibration/rotation.py``: every rotation kind orthogonal to 1e-10 in fp64, the bit-reversal permutation that
spreads the top eigendirections across groups, the Hadamard kinds' power-of-two head_dim, the whitening scale."""

from __future__ import annotations

import pytest
import torch

from oscar_export.calibration.rotation import (
    ROTATION_KINDS,
    bit_reversal,
    orthogonality_error,
    rotation,
    whitening_scale,
)

H_KV, D = 2, 32


def test_rotations_orthogonal_fp64():
    c = torch.randn(H_KV, D, 4 * D, dtype=torch.float64)
    target = c @ c.transpose(-1, -2)
    for kind in ROTATION_KINDS:
        for group in (D, D // 4):
            r = rotation(kind, target, group, seed=3)
            assert r.dtype == torch.float64 and r.shape == (H_KV, D, D)
            assert orthogonality_error(r) < 1e-10, (kind, group, orthogonality_error(r))


def test_bit_reversal_and_bad_head_dim():
    assert bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    with pytest.raises(NotImplementedError, match="power of two, got 48"):
        rotation("oscar", torch.eye(48).expand(1, 48, 48), 48)
    assert orthogonality_error(rotation("eig", torch.eye(48).expand(1, 48, 48), 48)) < 1e-12  # eig works for any D
    with pytest.raises(ValueError, match="rotation kind: expected one of"):
        rotation("qr", torch.eye(4)[None], 4)


def test_oscar_spreads_top_eigendirections_across_groups():
    """With G < D the eigenvalue-ordered bit reversal sends the two largest directions to different blocks."""
    lam = torch.tensor([100.0, 90.0] + [1.0] * (D - 2), dtype=torch.float64)
    r = rotation("oscar", torch.diag(lam)[None], D // 2)
    energy = (r[0] ** 2 * lam[:, None]).sum(0)  # per rotated coordinate
    blocks = sorted([float(energy[: D // 2].sum()), float(energy[D // 2 :].sum())])
    assert blocks == pytest.approx([90 + 15, 100 + 15])  # without the permutation: [16 - 2, 190 + 14]
    half = rotation("hadamard", torch.eye(D // 2)[None], D // 2)[0]
    plain = torch.eye(D, dtype=torch.float64) @ torch.block_diag(*[half] * 2)
    e2 = (plain**2 * lam[:, None]).sum(0)
    assert float(e2[: D // 2].sum()) == pytest.approx(204)


def test_whitening_scale_equalises_energy():
    c = torch.diag(torch.tensor([16.0, 4.0, 1.0, 0.25], dtype=torch.float64))[None]
    d = whitening_scale(c, torch.eye(4, dtype=torch.float64)[None])
    e = torch.diagonal(c[0]) * d[0] ** 2
    assert torch.allclose(e, e.mean().expand(4)) and abs(float(d.log().mean())) < 1e-12
