"""tests/kernels: exact comparisons of a Triton writer with the PyTorch reference, and the shared inputs and checks of
the Triton writer and decode-attention tests."""

from __future__ import annotations

import os

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout


def assert_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """``torch.equal(got, want)``, or an ``AssertionError`` naming the number of mismatches and the first five as
    ``(index, got, want)``."""
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        pairs = [(idx, got[tuple(idx)].item(), want[tuple(idx)].item()) for idx in bad]
        raise AssertionError(f"{name}: {(got != want).sum().item()} mismatches, first (index, got, want): {pairs}")


def assert_quantizes_like_reference(qp, device, x: torch.Tensor, layout: KVCacheLayout, fmt, clip: torch.Tensor,
                                    levels: torch.Tensor, operand: str = "key", **options):
    """Quantize the pages ``x [N, H_kv, P, D]`` with the Triton wrapper ``qp.quantize_pages`` (``x`` in its own dtype,
    on ``device``, with the wrapper's ``options``) and with ``reference.quantize_pages`` (``x`` in fp32, where it
    is): codes, then params, must be equal (:func:`assert_equal`). Returns the reference's ``(codes, params)``."""
    from oscar_export.kernels import reference

    want_c, want_p = reference.quantize_pages(x.float(), fmt, clip, levels, operand)
    got_c, got_p = qp.quantize_pages(x.to(device), layout, fmt, clip.to(device), levels.to(device), operand=operand,
                                     **options)
    assert_equal("codes", got_c.cpu(), want_c.cpu())
    assert_equal("params", got_p.cpu(), want_p.cpu())
    return want_c, want_p

def random_transform(h: int, d: int, seed: int = 0):
    """A ``LayerTransform`` of ``h`` KV heads of ``d`` with a random key rotation, key scaling and key / value means
    (clip 0.9 / 0.95, uniform levels): what a writer fusing the basis change must get right."""
    from dataclasses import replace

    from oscar_export.kernels.transform import LayerTransform

    g = torch.Generator().manual_seed(seed)
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0].contiguous()
    base = LayerTransform.identity(h, d, k_clip=0.9, v_clip=0.95)
    return replace(base, k_rotation=rot, k_scale=0.5 + torch.rand(h, d, generator=g),
                   k_mean=0.1 * torch.randn(h, d, generator=g), v_mean=0.1 * torch.randn(h, d, generator=g))


#: the quantizer tests' clip per KV head (the third cuts half the group) and fitted 2-bit levels per KV head.
CLIPS = torch.tensor([1.0, 0.96, 0.5])
LEVELS = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 0.8, 2.2, 3.0], [0.0, 1.3, 1.7, 3.0]])


def quant_rows(n: int, h: int, p: int, d: int) -> torch.Tensor:
    """Gaussian rows with outliers, ties (coarse grid) and one constant group: the quantizer's hard cases."""
    x = torch.randn(n, h, p, d) * torch.linspace(0.1, 3.0, d)
    x[..., ::7] = torch.round(x[..., ::7] * 4) / 4  # ties in |x| (the clip rank) and on code boundaries
    x[0, 0, 0] = 0.5  # a constant row: scale 0
    x[:, :, 1, 3] = 40.0  # an outlier the clip must cut
    return x


def book_state(lay: KVCacheLayout, bsz: int, max_length: int, device, dtype=torch.bfloat16):
    """A page book of ``bsz`` slots of ``max_length`` tokens and its empty pool on ``device``: ``(book, state)``."""
    from oscar_export.kernels.layout import PagedKV
    from oscar_export.kernels.pages import PageBook

    book = PageBook(lay, bsz, max_length, device)
    st = PagedKV.allocate(lay, bsz, book.num_pool_pages, book.max_pages, device=device, dtype=dtype)
    return book, st


def decode_steps(append, lay, tr, book, st, steps, bsz, seed, transform_in_kernel=False):
    """``steps`` decode steps through ``append(state, k, v, status)``; returns the stored-basis rows fed."""
    g = torch.Generator().manual_seed(seed)
    fed_k, fed_v = [], []
    for _ in range(steps):
        shape = (bsz, lay.num_kv_heads, lay.head_dim)
        k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        book.begin(1)
        committed = book.state_view(st, book.committed)
        append(committed, k.to(book.device), v.to(book.device), book.status)
        book.commit(1)
        if transform_in_kernel:
            k = tr.transform_keys(k.unsqueeze(2)).squeeze(2)
            v = v - tr.v_mean
        fed_k.append(k)
        fed_v.append(v)
    return torch.stack(fed_k, 2), torch.stack(fed_v, 2)  # [B, H_kv, steps, D]


#: the buffers of a ``PagedKV`` that a cache write fills.
BUFFERS = ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params")


def appends_equal_reference(ds, device, lay, tr, bsz, steps, max_length, seed, what, check=None):
    """``steps`` decode appends through the reference (CPU) and the Triton writer ``ds.decode_append``
    (``device``) from the same tokens; ``check(book_r, st_r, st_g)`` runs before every buffer is compared (equal,
    named by ``what``). Returns both books."""
    from oscar_export.kernels import reference as ref

    book_r, st_r = book_state(lay, bsz, max_length, "cpu")
    book_g, st_g = book_state(lay, bsz, max_length, device)
    decode_steps(lambda s, k, v, status: ref.decode_append(s, k, v, status, lay, tr), lay, tr, book_r, st_r,
                 steps, bsz, seed=seed)
    trd = tr.to(device)
    decode_steps(lambda s, k, v, status: ds.decode_append(s, k, v, status, lay, trd), lay, tr, book_g, st_g,
                 steps, bsz, seed=seed)
    if check is not None:
        check(book_r, st_r, st_g)
    for f in BUFFERS:
        assert_equal(f"{what} {f}", getattr(st_g, f).cpu(), getattr(st_r, f))
    return book_r, book_g


def ragged_cache(lay: KVCacheLayout, lengths: list[int], tr, spare_pages: int = 1):
    """A ragged batch (``PagedKV``) written through the reference (page ids shuffled so the block table matters)."""
    from oscar_export.kernels import reference as ref
    from oscar_export.kernels.layout import PagedKV

    h, d = lay.num_kv_heads, lay.head_dim
    max_pages = max(1, max(lay.pages_for(t) for t in lengths)) + spare_pages
    pool = len(lengths) * max_pages
    st = PagedKV.allocate(lay, len(lengths), pool, max_pages)
    free = torch.randperm(pool).tolist()
    scale = torch.linspace(0.3, 2.0, d)  # uneven channels, like real keys
    for b, t in enumerate(lengths):
        if t:
            k = torch.randn(h, t, d) * scale + 0.3
            v = torch.randn(h, t, d)
            ref.append_tokens(st, b, k, v, lay, tr, free.pop)
    return st


def attention_errors(got: torch.Tensor, q: torch.Tensor, st, lay: KVCacheLayout, tr, scale: float):
    """(kernel error, BF16 PyTorch error) against fp64, max abs over all outputs; plus the fp64 output."""
    from oscar_export.kernels import reference as ref

    k, v, valid = ref.gather_context(st, lay, tr.k_levels, tr.v_levels)  # [B, H_kv, T, D] fp32, [B, T]
    b, hq, d = q.shape
    hkv = lay.num_kv_heads
    mask = valid[:, None, None, :]

    def attend(qq, kk, vv, dt):
        qg = qq.to(dt).reshape(b, hkv, hq // hkv, d)
        s = torch.matmul(qg, kk.to(dt).transpose(-1, -2)).double() * scale
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        o = torch.matmul(p.to(dt), vv.to(dt))
        return o.reshape(b, hq, d).double()

    want = attend(q, k, v, torch.float64)
    bf16 = attend(q, k, v, torch.bfloat16)
    return (got.double().cpu() - want).abs(), (bf16 - want).abs().max().item(), want


def check_attention_budget(got, q, st, lay, tr, scale, what=""):
    """The decode-attention error budget (flash-attention's rule): ``got``'s max error against fp64 at
    most 2x a BF16 PyTorch computation's of the same attention over the same cache, plus 1e-5; on failure the
    five worst outputs. Returns ``(kernel error, BF16 error)``."""
    err, err_bf16, want = attention_errors(got, q, st, lay, tr, scale)
    budget = 2 * err_bf16 + 1e-5
    if not err.max().item() <= budget:
        flat = err.flatten().topk(5)
        idx = [torch.unravel_index(i, err.shape) for i in flat.indices]
        rows = [(tuple(int(j) for j in ix), float(got.cpu()[ix]), float(want[ix])) for ix in idx]
        raise AssertionError(f"{what}: max error {err.max().item():.3e} > budget {budget:.3e} "
                             f"(BF16 error {err_bf16:.3e}); worst (index, got, fp64): {rows}")
    return err.max().item(), err_bf16


def build_probe_bundle(out, cache, archs=None):
    """``build_bundle`` of the probe kernels (kernels/aot/probe.py) into ``out`` for ``archs`` (default: every
    target), with a private Triton cache ``cache`` so the compile really runs (not a cache hit). Returns ``out``."""

    from oscar_export.kernels.aot.compile import DEFAULT_ARCHS, build_bundle
    from oscar_export.kernels.aot.probe import probe_specs

    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    try:
        return build_bundle(probe_specs(), out, archs=DEFAULT_ARCHS if archs is None else archs)
    finally:
        if old is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = old


def hopper_wrapper():
    """The hopper decode kernel's wrapper module (``kernels/decode/hopper.py``), skipped without Gluon."""
    hopper = pytest.importorskip("oscar_export.kernels.decode.hopper")
    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    return hopper


def hopper_split_spec(gran, d, p, gq, key_bits=2):
    """The ``KernelSpec`` of the hopper split kernel (launch plan ``DECODE_SPLIT_GL``) for 8 KV heads of ``d`` in
    mma16 pages of ``p`` tokens, ``gq`` query heads per KV head, ``key_bits`` keys, with the plan's register cap."""
    from oscar_export.kernels.aot.launch_plan import DECODE_SPLIT_GL, decode_split_gl_constexprs, gl_occupancy
    from oscar_export.kernels.aot.spec import KernelSpec
    from oscar_export.kernels.decode import hopper_kernel

    lay = KVCacheLayout.default(8, d, key_granularity=gran, packing="mma16", page_size=p).with_key_bits(key_bits)
    cx = decode_split_gl_constexprs(lay, 8 * gq, d**-0.5)
    assert cx["KEY_BITS"] == key_bits
    cx.update(STAGES=hopper_kernel.STAGES)
    return KernelSpec.from_plan(DECODE_SPLIT_GL, f"decode_split_gl_{gran}_d{d}_p{p}_g{gq}_k{key_bits}", cx,
                                maxnreg=gl_occupancy(d)[0])


def mma_layout(codebook=False):
    """2 KV heads of 64 in mma16 pages of 64 (token keys, sink 16, window 64), fitted levels if ``codebook``."""
    from oscar_export.kernels.layout import RowFormat

    return KVCacheLayout(2, 64, RowFormat(64, 64, "token", codebook=codebook, packing="mma16"),
                         RowFormat(64, 64, codebook=codebook, packing="mma16"), sink=16, window=64, page_size=64)
