"""``calibration/objective.py``: the value queries' blocks (``Σ_blocks p^T p`` equals ``P^T P`` of the full
probabilities), the value screen, the quadratic-form key/value errors against a brute-force computation on
planted-structure data (``helpers.planted``), and its shared-sort quantizer against the reference bit for bit."""

from __future__ import annotations

import pytest
import torch

from oscar_export.calibration.capture import HeldOut
from oscar_export.calibration.covariance import causal_probs
from oscar_export.calibration.objective import LayerObjective, roundtrip, value_queries
from oscar_export.calibration.rotation import rotation
from oscar_export.kernels.layout import RowFormat
from oscar_export.kernels.reference import dequantize_pages, quantize_pages

from helpers import PLANTED_SHAPE, planted

H_KV, G, D, T, P = PLANTED_SHAPE


def naive_value_weights(q, k, scaling, lo, tv, window):
    """``M`` from the ``[T, T]`` probabilities of every head at once, fp64, over query positions ``lo .. T-1`` (the
    definition)."""
    n, h, t, _ = q.shape
    hkv = k.shape[1]
    pos = torch.arange(lo, t)
    p = causal_probs(q, k, scaling)[..., pos, lo : lo + tv].double()  # [N, H_kv, g, Q, T_v]
    if window > 0:
        p = p * (pos[:, None] - torch.arange(lo, lo + tv)[None, :] > window)
    p = p.reshape(n, hkv, -1, tv)
    return p.transpose(-1, -2) @ p / p.shape[2]


@pytest.mark.parametrize("t,lo,tv,window,block", [(96, 16, 64, 32, 16), (97, 16, 48, 0, 32), (130, 8, 112, 5, 24),
                                                  (64, 0, 64, 0, 64), (80, 16, 16, 40, 7), (200, 64, 64, 64, 16)])
def test_value_queries_give_the_full_product(t, lo, tv, window, block):
    torch.manual_seed(t + window)
    q, k = torch.randn(2, 6, t, 16) * 2, torch.randn(2, 2, t, 16) * 2
    blocks, count = value_queries(q, k, 0.25, lo, tv, window, block=block)
    got = torch.zeros(2, 2, tv, tv, dtype=torch.float64)
    for i, seq in enumerate(blocks):
        for pb in seq:
            c = pb.shape[-1]
            got[i, :, :c, :c] += (pb.transpose(-1, -2) @ pb).double()
    want = naive_value_weights(q, k, 0.25, lo, tv, window)
    assert count == 3 * (t - lo)
    err = (got / count - want).abs().max()
    assert err <= 1e-6 * want.abs().max(), f"worst |M - M_ref| {err:.3g} of max {want.abs().max():.3g}"


def test_the_value_screen_is_the_value_error_over_every_8th_query_position():
    """``value_errors(screen=True)`` = the brute-force attention-output error over query positions ``lo, lo + 8, ...``
    (sequences long enough for several ``VALUE_BLOCK`` blocks and the window)."""
    from oscar_export.calibration.capture import HeldOut
    from oscar_export.calibration.objective import SCREEN_STRIDE, VALUE_BLOCK, LayerObjective
    from oscar_export.kernels.layout import RowFormat
    from oscar_export.kernels.reference import dequantize_pages, quantize_pages

    torch.manual_seed(5)
    n, hkv, g, t, d, skip, page, window = 2, 2, 3, 2 * VALUE_BLOCK + 40, 16, 16, 16, 40
    q, k, v = torch.randn(n, hkv * g, t, d) * 2, torch.randn(n, hkv, t, d) * 2, torch.randn(n, hkv, t, d)
    obj = LayerObjective.build(HeldOut(q, k, v, d**-0.5), skip, page, window)
    fmt, clip = RowFormat(d, d), torch.full((hkv,), 0.9)
    lv = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(hkv, 4)
    r, s, mu = torch.eye(d, dtype=torch.float64).expand(hkv, d, d), torch.ones(hkv, d, dtype=torch.float64), \
        torch.zeros(hkv, d, dtype=torch.float64)
    tv = obj.v.shape[2]
    x = v[:, :, skip : skip + tv]
    pg = x.reshape(n, hkv, tv // page, page, d).transpose(1, 2).reshape(-1, hkv, page, d)
    back = dequantize_pages(*quantize_pages(pg, fmt, clip, lv), fmt, lv)
    dv = back.reshape(n, tv // page, hkv, page, d).transpose(1, 2).reshape(n, hkv, tv, d).double() - x.double()
    sc = torch.einsum("nhgid,nhtd->nhgit", q.double().reshape(n, hkv, g, t, d), k.double()) * d**-0.5
    sc = sc.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    pos = torch.arange(skip, t, SCREEN_STRIDE)
    p = torch.softmax(sc, -1)[:, :, :, pos, skip : skip + tv]
    p = p * (pos[:, None] - torch.arange(skip, skip + tv)[None, :] > window)
    want = (torch.einsum("nhgit,nhtd->nhgid", p, dv) ** 2).sum(-1).mean(dim=(2, 3)).mean(0)
    got = obj.value_errors(r, s, mu, [clip], lv, fmt, screen=True)[0]
    assert obj.count_screen == g * len(pos)
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    assert not torch.allclose(obj.value_errors(r, s, mu, [clip], lv, fmt)[0], want, rtol=1e-3)  # not the full error


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
