"""The clip threshold's helpers (kernels/clip_threshold.py) on their own: a small kernel built of them, as the
quantizer's passes use them (one load a round, ``C`` values a thread, lists merged across the row, rounds below a
cut until every row is resolved), finds the K-th largest ``|x|`` of each row exactly, ties and ``K > 8`` included,
and the first round's lists and min/max are the row's. On the CPU through Triton's interpreter
(tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from oscar_export.kernels import clip_threshold as ct  # noqa: E402


@triton.jit
def _kth_largest_kernel(x_ptr, k_ptr, thr_ptr, top_ptr, mn_ptr, mx_ptr, S: tl.constexpr, N: tl.constexpr,
                        C: tl.constexpr):
    r = tl.arange(0, S)
    x = tl.load(x_ptr + r[:, None] * N + tl.arange(0, N)[None, :])
    inf = tl.full((S,), float("inf"), tl.float32)
    neg = tl.full((S, N // C), -1.0, tl.float32)
    cnt = tl.zeros((S, N), tl.int32)
    mn = tl.full((S, N), float("inf"), tl.float32)
    mx = tl.full((S, N), float("-inf"), tl.float32)
    a, mn, mx, cnt = ct.prep(x, inf[:, None], inf[:, None], mn, mx, cnt, True)
    t0, t1, t2, t3, t4, t5, t6, t7 = ct.ins_chunks(neg, neg, neg, neg, neg, neg, neg, neg,
                                                    tl.reshape(a, (S, N // C, C)), C, True)
    t0, t1, t2, t3, t4, t5, t6, t7 = tl.reduce((t0, t1, t2, t3, t4, t5, t6, t7), 1, ct.merge8)
    tl.store(top_ptr + r * 8 + 0, t0)
    tl.store(top_ptr + r * 8 + 1, t1)
    tl.store(top_ptr + r * 8 + 2, t2)
    tl.store(top_ptr + r * 8 + 3, t3)
    tl.store(top_ptr + r * 8 + 4, t4)
    tl.store(top_ptr + r * 8 + 5, t5)
    tl.store(top_ptr + r * 8 + 6, t6)
    tl.store(top_ptr + r * 8 + 7, t7)
    tl.store(mn_ptr + r, tl.min(mn, 1))
    tl.store(mx_ptr + r, tl.max(mx, 1))
    kr, done, thr = ct.resolve(t0, t1, t2, t3, t4, t5, t6, t7, tl.sum(cnt, 1), inf, tl.load(k_ptr + r),
                                tl.zeros((S,), tl.int32), tl.zeros((S,), tl.float32))
    cut = inf
    while tl.min(done, 0) == 0:
        bound = cut
        cut = t7
        cnt = tl.zeros((S, N), tl.int32)
        a, mn, mx, cnt = ct.prep(x, cut[:, None], bound[:, None], mn, mx, cnt, False)
        t0, t1, t2, t3, t4, t5, t6, t7 = ct.ins_chunks(neg, neg, neg, neg, neg, neg, neg, neg,
                                                        tl.reshape(a, (S, N // C, C)), C, True)
        t0, t1, t2, t3, t4, t5, t6, t7 = tl.reduce((t0, t1, t2, t3, t4, t5, t6, t7), 1, ct.merge8)
        kr, done, thr = ct.resolve(t0, t1, t2, t3, t4, t5, t6, t7, tl.sum(cnt, 1), cut, kr, done, thr)
    tl.store(thr_ptr + r, thr)


def _rows(n: int) -> torch.Tensor:
    """8 rows of ``n``: random; few distinct magnitudes and one magnitude (ties across every round); an ascending
    ramp (the largest values in the last thread's chunk: every merge takes from both lists); the 8th/9th and
    16th/17th largest tied (a round whose count reaches the rank exactly); one value half the row; all negative;
    a ramp reversed within each chunk of 8."""
    g = torch.Generator().manual_seed(n)
    ramp = torch.arange(1, n + 1, dtype=torch.float32)
    x = torch.randn(8, n, generator=g)
    x[1] = torch.randint(-3, 4, (n,), generator=g).float()
    x[2] = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    x[3] = ramp
    x[4] = ramp
    x[4, n - 9], x[4, n - 17] = n - 7, n - 15
    x[5, : n // 2] = 7.0
    x[6] = x[6].abs() * -1
    x[7] = -ramp.view(-1, 8).flip(1).flatten()
    return x


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_kth_largest_magnitude_exact(ct_mod, device, c):
    n = 64
    x = _rows(n).to(device)
    want_sorted = x.abs().sort(dim=1, descending=True).values
    for ks in ([1, 2, 8, 9, 17, 16, 40, 64], [64, 63, 33, 24, 9, 3, 10, 58]):
        k = torch.tensor(ks, dtype=torch.int32, device=device)
        thr, top, mn, mx = (torch.empty(s, device=device) for s in ((8,), (8, 8), (8,), (8,)))
        _kth_largest_kernel[(1,)](x, k, thr, top, mn, mx, 8, n, c)
        want = want_sorted[torch.arange(8, device=device), k.long() - 1]
        assert torch.equal(thr, want), f"K {ks}: got {thr.tolist()}, want {want.tolist()}"
        assert torch.equal(top, want_sorted[:, :8]), "the first round's lists are the 8 largest |x|"
        assert torch.equal(mn, x.min(1).values) and torch.equal(mx, x.max(1).values)
