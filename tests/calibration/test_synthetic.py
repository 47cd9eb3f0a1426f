"""Planted-structure attention data: the calibrated transform must beat identity and Hadamard on the
attention-aware held-out error, per-head must beat shared when the heads disagree, fitted clipping must
match or beat the global ratios, and every rotation must be orthogonal to 1e-10 in fp64."""

from __future__ import annotations

import pytest
import torch

from oscar_export.calibration.capture import HeldOut
from oscar_export.calibration.clipping import clip_grid, fit_clip
from oscar_export.calibration.covariance import LayerStats
from oscar_export.calibration.objective import LayerObjective, roundtrip
from oscar_export.calibration.pipeline import CalibrationConfig, fit_layer
from oscar_export.calibration.rotation import (
    ROTATION_KINDS,
    bit_reversal,
    orthogonality_error,
    random_orthogonal,
    rotation,
    whitening_scale,
)
from oscar_export.kernels.layout import RowFormat
from oscar_export.kernels.reference import dequantize_pages, quantize_pages

H_KV, G, D, T, P = 2, 3, 32, 96, 16


def planted(n: int, seed: int, disagree: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[n, H_kv*G, T, D]``, k, v ``[n, H_kv, T, D]``.

    Keys: two outlier channels with a large offset and variance, on top of small isotropic noise; queries:
    rank-3, living where the keys are quiet. Each KV head sees the same structure in its own random basis
    (``disagree``) or in a common one.
    """
    g = torch.Generator().manual_seed(seed)
    basis = random_orthogonal(H_KV if disagree else 1, D, 7).float().expand(H_KV, D, D)
    kz = 0.3 * torch.randn(n, H_KV, T, D, generator=g)
    kz[..., :2] = 6.0 + 3.0 * torch.randn(n, H_KV, T, 2, generator=g)
    qz = torch.zeros(n, H_KV, G, T, D)
    qz[..., 4:7] = 2.0 * torch.randn(n, H_KV, G, T, 3, generator=g)
    qz[..., :2] = 0.05 * torch.randn(n, H_KV, G, T, 2, generator=g)
    vz = torch.randn(n, H_KV, T, D, generator=g)
    vz[..., 5] *= 8.0
    k = kz @ basis[None]
    v = vz @ basis[None]
    q = (qz @ basis[None, :, None]).reshape(n, H_KV * G, T, D)
    return q, k, v


def stats_and_objective(disagree=True, skip=0):
    q, k, v = planted(8, 0, disagree)
    st = LayerStats(H_KV, D, "cpu")
    st.update(q, k, v, D**-0.5, skip)
    hq, hk, hv = planted(3, 1, disagree)
    obj = LayerObjective.build(HeldOut(hq, hk, hv, D**-0.5), skip, P, 0)
    return st, obj


def cfg(**kw) -> CalibrationConfig:
    base = dict(tokens=10 * T, seq_len=T, heldout=1, sink=0, window=0, page_size=P, key_granularity="token")
    base.update(kw)
    return CalibrationConfig(**base)


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


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_calibrated_beats_identity_and_hadamard(granularity):
    st, obj = stats_and_objective()
    c = cfg(key_granularity=granularity)
    layout = c.layout(H_KV, D)
    k, v = fit_layer(0, st, obj, layout, c)
    # Reference points fitted the same way (fitted clips) with a fixed rotation.
    k_had, v_had = fit_layer(0, st, obj, layout, cfg(key_granularity=granularity, rotation="hadamard"))
    k_id, v_id = fit_layer(0, st, obj, layout, cfg(key_granularity=granularity, rotation="identity"))
    print(granularity, "K", k.error.tolist(), k_had.error.tolist(), k_id.error.tolist(), k.chosen)
    print(granularity, "V", v.error.tolist(), v_had.error.tolist(), v_id.error.tolist(), v.chosen)
    for fit, had, ident in ((k, k_had, k_id), (v, v_had, v_id)):
        assert bool((fit.error <= had.error).all()) and bool((fit.error <= ident.error).all())
        assert float(fit.error.sum()) < 0.9 * float(had.error.sum())
        assert float(fit.error.sum()) < 0.5 * float(ident.error.sum())
        assert float(fit.error.sum()) < 0.5 * float(fit.baselines["identity"].sum())


def test_per_head_beats_shared_when_heads_disagree():
    st, obj = stats_and_objective(disagree=True)
    layout = cfg().layout(H_KV, D)
    per = fit_layer(0, st, obj, layout, cfg(rotation="eig", scale="whiten"))
    shared = fit_layer(0, st, obj, layout, cfg(rotation="eig", scale="whiten", per_head=False))
    # Keys: the queries' subspace differs per head, so one basis cannot serve both.
    print(per[0].error.tolist(), shared[0].error.tolist())
    assert float(per[0].error.sum()) < 0.6 * float(shared[0].error.sum())
    auto_per = fit_layer(0, st, obj, layout, cfg())
    auto_shared = fit_layer(0, st, obj, layout, cfg(per_head=False))
    assert float(auto_per[0].error.sum()) < 0.6 * float(auto_shared[0].error.sum())
    # Sanity of the control: when the heads agree, sharing loses (almost) nothing.
    st2, obj2 = stats_and_objective(disagree=False)
    per2 = fit_layer(0, st2, obj2, layout, cfg(rotation="eig", scale="whiten"))
    sh2 = fit_layer(0, st2, obj2, layout, cfg(rotation="eig", scale="whiten", per_head=False))
    assert float(sh2[0].error.sum()) < 1.1 * float(per2[0].error.sum())


@pytest.mark.parametrize("side", ["k", "v"])
def test_fitted_clip_no_worse_than_global(side):
    st, obj = stats_and_objective()
    fmt = RowFormat(D, D)
    r = rotation("hadamard", st.key_target(), D)
    one, zero = torch.ones(H_KV, D, dtype=torch.float64), torch.zeros(H_KV, D, dtype=torch.float64)
    lv = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(H_KV, 4)
    err = obj.key_errors if side == "k" else obj.value_errors
    fn = lambda cs: err(r, one, zero, cs, lv, fmt)  # noqa: E731
    fit = fit_clip(fn, H_KV, clip_grid(D), per_head=True)
    glob = fn([torch.full((H_KV,), 0.96 if side == "k" else 0.92)])[0].double()
    assert bool((fit.error <= glob).all()), (fit.error, glob)
    assert torch.equal(fit.error_at(0.96 if side == "k" else 0.92), glob)
    shared = fit_clip(fn, H_KV, clip_grid(D), per_head=False)
    assert float(fit.error.sum()) <= float(shared.error.sum())


def test_objective_matches_brute_force():
    """The quadratic-form key/value errors equal a direct computation over query/key pairs."""
    q, k, v = planted(2, 5)
    held = HeldOut(q, k, v, D**-0.5)
    obj = LayerObjective.build(held, 16, P, 0)
    fmt = RowFormat(D, D)
    r = rotation("random", torch.eye(D).expand(H_KV, D, D), D, seed=1)
    s = torch.rand(H_KV, D, dtype=torch.float64) + 0.5
    mu = torch.randn(H_KV, D, dtype=torch.float64)
    clip, lv = torch.full((H_KV,), 0.9), torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(H_KV, 4)

    def roundtrip(x):  # [N, H, Tq, D] stored basis through the reference quantizer
        n, h, tq, d = x.shape
        pg = x.float().reshape(n, h, tq // P, P, d).transpose(1, 2).reshape(-1, h, P, d)
        back = dequantize_pages(*quantize_pages(pg, fmt, clip, lv), fmt, lv)
        return back.reshape(n, tq // P, h, P, d).transpose(1, 2).reshape(n, h, tq, d).double()

    tq = (T - 16) // P * P
    ks = (k[:, :, 16 : 16 + tq].double() @ r) * s[:, None] - mu[:, None]
    qs = (q[:, :, 16:].double().reshape(2, H_KV, G, -1, D) @ r[:, None]) / s[:, None, None]
    dk = roundtrip(ks) - ks
    # Every held-out query against every held-out key (pooled over the sequences).
    q_all = qs.transpose(0, 1).reshape(H_KV, -1, D)
    k_all = dk.transpose(0, 1).reshape(H_KV, -1, D)
    score_err = torch.einsum("hid,htd->hit", q_all, k_all) * D**-0.5
    brute_k = (score_err**2).mean(dim=(1, 2))
    # rows enter the quantizer as fp32
    assert torch.allclose(obj.key_error(r, s, mu, clip, lv, fmt), brute_k, rtol=1e-6)

    vs = (v[:, :, 16 : 16 + tq].double() @ r) * s[:, None] - mu[:, None]
    dv = (roundtrip(vs) - vs) / s[:, None]
    sc = torch.einsum("nhgid,nhtd->nhgit", q.double().reshape(2, H_KV, G, T, D), k.double()) * D**-0.5
    sc = sc.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(sc, -1)[:, :, :, 16:, 16 : 16 + tq]
    do = torch.einsum("nhgit,nhtd->nhgid", p, dv)
    brute_v = (do**2).sum(-1).mean(dim=(2, 3)).mean(0)
    # rows enter the quantizer as fp32
    assert torch.allclose(obj.value_error(r, s, mu, clip, lv, fmt), brute_v, rtol=1e-6)


@pytest.mark.parametrize("granularity,group", [("token", 32), ("token", 8), ("channel", 32)])
def test_fast_roundtrip_is_the_reference_bit_for_bit(granularity, group):
    """The objective's shared-sort quantizer equals quantize_pages/dequantize_pages exactly."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, H_KV, P, D, generator=g) * torch.rand(1, 1, 1, D, generator=g) * 4
    x[0, 0, 3, 7] = 40.0  # an outlier the clip must catch
    fmt = RowFormat(D, group, granularity)
    levels = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.1, 0.9, 2.2, 2.95]])
    clips = [torch.tensor([1.0, 1.0]), torch.tensor([0.96, 0.92]), torch.tensor([0.5, 0.8])]
    fast = roundtrip(x, fmt, clips, levels)
    for clip, xh in zip(clips, fast):
        ref = dequantize_pages(*quantize_pages(x, fmt, clip, levels), fmt, levels)
        bad = (xh != ref).nonzero()
        assert torch.equal(xh, ref), f"{len(bad)} mismatches, first {bad[:5].tolist()}"


def test_value_clips_are_one_grid_step_milder_than_the_fit_and_their_error_is_measured_there():
    """``fit_side`` of values keeps the fitted rotation but moves each head's clip ``VALUE_CLIP_STEPS`` grid steps
    toward 1.0 and reports the held-out error at that clip; keys keep the fitted clip."""
    from oscar_export.calibration.clipping import VALUE_CLIP_STEPS, milder
    from oscar_export.calibration.pipeline import fit_side

    assert VALUE_CLIP_STEPS == 1
    st, obj = stats_and_objective()
    fmt = RowFormat(D, D)
    c = cfg(rotation="hadamard", value_mean=False, key_mean=False)
    lv = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(H_KV, 4)
    one, zero = torch.ones(H_KV, D, dtype=torch.float64), torch.zeros(H_KV, D, dtype=torch.float64)
    for side, target, err in (("v", st.value_target("prob"), obj.value_errors), ("k", st.key_target(), obj.key_errors)):
        fn = lambda r, s, mu, cs, lv, err=err: err(r, s, mu, cs, lv, fmt)  # noqa: E731
        got = fit_side(side, target, target, torch.zeros(H_KV, D), fn, None, fmt, D, c, seed=0)
        r = rotation("hadamard", target, D, 0)
        fit = fit_clip(lambda cs: fn(r, one, zero, cs, lv), H_KV, clip_grid(D))
        want = milder(fit.clip, clip_grid(D), 1) if side == "v" else fit.clip
        assert torch.equal(got.clip, want), (side, got.clip, fit.clip)
        assert torch.allclose(got.error, fn(r, one, zero, [want], lv)[0].double(), rtol=1e-12)
        assert side == "k" or not torch.equal(got.clip, fit.clip)  # the planted values' fit clips: some move
