"""Decode attention v2 (mma16 pages) against an fp64 evaluation of ``reference.gather_context``.

The error budget and the cache builder are test_decode_attention.py's (v1): on the same packed cache the
kernel's max error against fp64 must be at most 2x that of a BF16 PyTorch computation, plus 1e-5. The
reference reads the mma16 pages through ``reference.unpack_page_codes``, so the kernel and the oracle see
the same codes. On the CPU this runs through Triton's interpreter (tests/kernels/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout, PagedKV, RowFormat
from oscar_export.kernels.transform import LayerTransform

from conftest import BOUNDARY_LENGTHS
from test_decode_attention import _cache, _check_budget


def _mma(h_kv: int, d: int, gran: str, codebook: bool = False, **kw) -> KVCacheLayout:
    return KVCacheLayout(h_kv, d, RowFormat(d, d, gran, codebook=codebook, packing="mma16"),
                         RowFormat(d, d, codebook=codebook, packing="mma16"), **kw)


def _dev(st: PagedKV, device) -> PagedKV:
    return PagedKV(**{f: getattr(st, f).to(device) for f in st.__dataclass_fields__})


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_v2_boundary_lengths_ragged_batch(da2, device, gran):
    """Boundary lengths (an empty sequence too), one KV head of 3 query heads, P = 64."""
    lay = _mma(1, 64, gran, page_size=64)
    tr = LayerTransform.identity(1, 64, k_clip=0.96, v_clip=0.92)
    lengths = [0] + BOUNDARY_LENGTHS[gran == "channel"::2]
    st = _cache(lay, lengths, tr)
    q = torch.randn(len(lengths), 3, 64)
    got = da2.decode_attention(q.to(device), _dev(st, device), lay, tr.k_levels.to(device), tr.v_levels.to(device),
                               64**-0.5, pages_per_split=4)
    assert torch.equal(got[0].cpu(), torch.zeros(3, 64)), "an empty sequence must give zeros"
    _check_budget(got, q, st, lay, tr, 64**-0.5, f"v2 boundary {gran}")


@pytest.mark.parametrize("variant", ["fields", "tile"])
@pytest.mark.parametrize("hq,hkv,d,p,gran", [(4, 1, 128, 128, "token"), (8, 2, 128, 64, "channel"),
                                             (6, 2, 64, 32, "token"), (2, 2, 64, 64, "channel")])
def test_v2_gqa_head_dims_page_sizes(da2, device, hq, hkv, d, p, gran, variant):
    lay = _mma(hkv, d, gran, sink=16, window=32, page_size=p)
    tr = LayerTransform.identity(hkv, d, k_clip=0.95, v_clip=0.9)
    if variant == "fields" and p < 64:
        st = _dev(PagedKV.allocate(lay, 1, 1, 1), device)
        lv = (tr.k_levels.to(device), tr.v_levels.to(device))
        with pytest.raises(NotImplementedError, match="'fields': page_size 64 or 128"):
            da2.decode_attention(torch.randn(1, hq, d, device=device), st, lay, *lv, 0.1, variant=variant)
        return
    lengths = [3, 16 + 32 + p + 1, 16 + 32 + 3 * p + 17]
    st = _cache(lay, lengths, tr)
    q = torch.randn(len(lengths), hq, d) * 2
    got = da2.decode_attention(q.to(device), _dev(st, device), lay, tr.k_levels.to(device), tr.v_levels.to(device),
                               d**-0.5, pages_per_split=2, out_dtype=torch.bfloat16, variant=variant)
    assert got.dtype == torch.bfloat16
    _check_budget(got.float(), q, st, lay, tr, d**-0.5, f"v2 {variant} gqa {hq}/{hkv} d={d} p={p} {gran}")


@pytest.mark.parametrize("variant", ["fields", "tile"])
@pytest.mark.parametrize("gran", ["token", "channel"])
def test_v2_codebook_rotation_and_splits(da2, device, gran, variant):
    """Fitted levels, q·R_K/d fused into the prologue, and split counts 1 and 64."""
    hkv, hq, d = 2, 8, 64
    lay = _mma(hkv, d, gran, codebook=True, sink=16, window=32, page_size=64)
    rot = torch.linalg.qr(torch.randn(hkv, d, d))[0].contiguous()
    ident = LayerTransform.identity(hkv, d, 0.9, 0.9)
    tr = LayerTransform(
        k_rotation=rot, v_rotation=ident.v_rotation, k_scale=torch.rand(hkv, d) + 0.5, v_scale=ident.v_scale,
        k_mean=ident.k_mean, v_mean=ident.v_mean, k_clip=ident.k_clip, v_clip=ident.v_clip,
        k_levels=torch.tensor([[0.0, 0.7, 2.1, 3.0], [0.0, 1.2, 1.9, 3.0]]),
        v_levels=torch.tensor([[0.0, 0.9, 2.2, 3.0], [0.0, 1.0, 2.0, 3.0]]),
    )
    st = _cache(lay, [200, 500], tr)
    q_model = torch.randn(2, hq, d)
    q_stored = tr.transform_queries(q_model[:, :, None]).squeeze(2)
    dev_st = _dev(st, device)
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    fused = da2.decode_attention(q_model.to(device), dev_st, lay, *lv, d**-0.5,
                                 q_rotation=(rot.to(device), tr.k_scale.to(device)), pages_per_split=2, variant=variant)
    _check_budget(fused, q_stored, st, lay, tr, d**-0.5, f"v2 codebook+rotation {gran}")
    for n in (1, 64):
        o = da2.decode_attention(q_stored.to(device), dev_st, lay, *lv, d**-0.5, pages_per_split=n, variant=variant)
        _check_budget(o, q_stored, st, lay, tr, d**-0.5, f"v2 codebook {gran} pages_per_split={n}")


def test_v2_matches_v1_on_the_same_tokens(da2, device):
    """The same tokens written linear (read by v1) and mma16 (read by v2): both within budget, and close."""
    from oscar_export.kernels import decode_attention as v1  # noqa: F401  (imported through da2's module)

    hkv, hq, d = 2, 8, 128
    lin = KVCacheLayout.default(hkv, d, "token", sink=16, window=32, page_size=64)
    mma = _mma(hkv, d, "token", sink=16, window=32, page_size=64)
    tr = LayerTransform.identity(hkv, d, k_clip=0.96, v_clip=0.92)
    torch.manual_seed(5)
    st_l = _cache(lin, [400, 333], tr)
    torch.manual_seed(5)
    st_m = _cache(mma, [400, 333], tr)
    assert torch.equal(st_l.k_params, st_m.k_params) and not torch.equal(st_l.k_codes, st_m.k_codes)
    q = torch.randn(2, hq, d)
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    o1 = da2.decode_attention_any(q.to(device), _dev(st_l, device), lin, *lv, d**-0.5, pages_per_split=2)
    o2 = da2.decode_attention_any(q.to(device), _dev(st_m, device), mma, *lv, d**-0.5, pages_per_split=2)
    e1, _ = _check_budget(o1, q, st_l, lin, tr, d**-0.5, "v1")
    e2, _ = _check_budget(o2, q, st_m, mma, tr, d**-0.5, "v2")
    assert (o1.cpu() - o2.cpu()).abs().max().item() <= e1 + e2 + 1e-6


def test_v2_bad_inputs_raise(da2, device):
    """Linear pages, mixed packings, an unsupported head_dim / GQA ratio / group size: one clear error each."""
    tr = LayerTransform.identity(1, 64)
    lin = KVCacheLayout.default(1, 64, sink=16, window=32)
    st = PagedKV.allocate(lin, 1, 2, 2, device=device)
    q = torch.randn(1, 2, 64, device=device)
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    with pytest.raises(ValueError, match="reads 'mma16' pages, the layout has key 'linear'"):
        da2.decode_attention(q, st, lin, *lv, 0.125)
    k4 = KVCacheLayout(1, 64, RowFormat(64, 64, bits=4), RowFormat(64, 64, packing="mma16"), sink=16, window=32)
    with pytest.raises(NotImplementedError, match="2-bit pages only, the layout has 4-bit keys"):
        da2.decode_attention(q, PagedKV.allocate(k4, 1, 2, 2, device=device), k4, *lv, 0.125)
    mixed = KVCacheLayout(1, 64, RowFormat(64, 64, packing="mma16"), RowFormat(64, 64), sink=16, window=32)
    with pytest.raises(NotImplementedError, match="both linear \\(v1\\) or both mma16 \\(v2\\)"):
        da2.decode_attention_any(q, st, mixed, *lv, 0.125)
    mma = _mma(1, 64, "token", sink=16, window=32)
    with pytest.raises(NotImplementedError, match="GQA ratios"):
        da2.decode_attention(torch.randn(1, 9, 64, device=device), st, mma, *lv, 0.125)
    with pytest.raises(NotImplementedError, match="head_dim \\[64, 128, 256\\] supported, got 96"):
        da2.check_decode_v2_layout(_mma(1, 96, "token", sink=16, window=32), 2)
    g32 = KVCacheLayout(1, 64, RowFormat(64, 32, packing="mma16"), RowFormat(64, 32, packing="mma16"))
    with pytest.raises(NotImplementedError, match="group_size must equal head_dim"):
        da2.check_decode_v2_layout(g32, 2)
    with pytest.raises(ValueError, match="q: expected head_dim 64, got 32"):
        da2.decode_attention(torch.randn(1, 2, 32, device=device), st, mma, *lv, 0.125)


@pytest.mark.parametrize("variant", [None, "tile"])
def test_custom_op_over_mma16_pages_matches_wrapper(da2, device, variant):
    """``triton_ops.decode_attention`` picks ``oscar::decode_attention_v2`` for mma16 pages (the serving path) and
    launches exactly v2's kernels (bitwise equal), also through the HF backend with the layer's decode variant;
    a variant for linear pages is refused."""
    from types import SimpleNamespace

    from oscar_export.kernels import triton_ops
    from oscar_export.plugins.hf.cache import TransformFlags
    from oscar_export.plugins.hf.triton_backend import triton_ops as backend

    lay = _mma(2, 64, "channel", sink=16, window=32, page_size=64)
    tr = LayerTransform.identity(2, 64, 0.95, 0.9)
    st = _dev(_cache(lay, [7, 300], tr), device)
    q = torch.randn(2, 8, 64, device=device)
    lv = (tr.k_levels.to(device), tr.v_levels.to(device))
    want = da2.decode_attention(q, st, lay, *lv, 0.125, variant=variant or "fields", out_dtype=torch.bfloat16)
    got = triton_ops.decode_attention(q, st, lay, *lv, 0.125, variant=variant, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    trd = tr.to(device)
    layer = SimpleNamespace(layout=lay, transform=trd, flags=TransformFlags.of(trd), pages_per_split=None,
                            decode_variant=variant)
    assert torch.equal(backend().decode_attention(layer, q.bfloat16(), st, 0.125),
                       da2.decode_attention(q.bfloat16(), st, lay, *lv, 0.125, variant=variant or "fields",
                                            out_dtype=torch.bfloat16))
    lin = KVCacheLayout.default(2, 64, sink=16, window=32)
    with pytest.raises(ValueError, match="linear pages have one decode kernel"):
        triton_ops.decode_attention(q, PagedKV.allocate(lin, 2, 2, 2, device=device), lin, *lv, 0.125, variant="tile")
