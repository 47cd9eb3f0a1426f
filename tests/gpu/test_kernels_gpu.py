"""The Triton kernels at real shapes on a CUDA GPU (run on the H200; skipped without CUDA).

    python -m pytest tests/gpu/test_kernels_gpu.py -m gpu -s

Checks: quantize/pack bit-exact against the reference (computed on the same GPU) at a prefill's size, both
key granularities; decode attention (32 query / 8 KV heads, head_dim 128, sequences up to 33K tokens) within
the error budget (<= 2x a BF16 PyTorch computation's error against fp64, + 1e-5); a decode step (append,
demotion when due, attention) captured in a CUDA graph and replayed across a demotion, equal to eager.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

triton = pytest.importorskip("triton")

from oscar_export.kernels import reference as ref  # noqa: E402
from oscar_export.kernels.decode_attention import decode_attention  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout, PagedKV  # noqa: E402
from oscar_export.kernels.decode_step import decode_step_update  # noqa: E402
from oscar_export.kernels.quant_pack import quantize_pages  # noqa: E402
from oscar_export.kernels.transform import LayerTransform  # noqa: E402

DEV = torch.device("cuda")


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_quantize_real_shape_bit_exact(gran):
    lay = KVCacheLayout.default(8, 128, gran)
    x = (torch.randn(256, 8, 128, 128, device=DEV) * torch.linspace(0.1, 3, 128, device=DEV)).bfloat16().float()
    clip = torch.tensor([1.0, 0.99, 0.96, 0.92, 0.9, 0.8, 0.7, 0.5], device=DEV)
    levels = torch.tensor([0.0, 1.0, 2.0, 3.0], device=DEV).repeat(8, 1)
    want = ref.quantize_pages(x, lay.key, clip, levels)
    got = quantize_pages(x, lay, lay.key, clip, levels)
    for name, g, w in zip(("codes", "params"), got, want):
        mism = (g != w).sum().item()
        assert mism == 0, f"{gran} {name}: {mism} mismatches, first at {(g != w).nonzero()[:3].tolist()}"


def _random_cache(lay: KVCacheLayout, lengths: list[int], tr: LayerTransform) -> PagedKV:
    """Through the reference writer on the GPU (whole pages at once), page ids shuffled."""
    h, d = lay.num_kv_heads, lay.head_dim
    max_pages = max(lay.pages_for(t) for t in lengths) + 2
    pool = len(lengths) * max_pages
    st = PagedKV.allocate(lay, len(lengths), pool, max_pages, device=DEV)
    free = torch.randperm(pool).tolist()
    for b, t in enumerate(lengths):
        k = torch.randn(h, t, d, device=DEV) * torch.linspace(0.2, 2, d, device=DEV) + 0.2
        ref.append_tokens(st, b, k, torch.randn(h, t, d, device=DEV), lay, tr, free.pop)
    return st


def _budget(got, q, st, lay, tr, scale):
    k, v, valid = ref.gather_context(st, lay, tr.k_levels, tr.v_levels)
    b, hq, d = q.shape
    hkv = lay.num_kv_heads

    def attend(dt):
        qg = q.to(dt).reshape(b, hkv, hq // hkv, d)
        s = torch.matmul(qg, k.to(dt).transpose(-1, -2)).double() * scale
        p = torch.softmax(s.masked_fill(~valid[:, None, None, :], float("-inf")), -1).nan_to_num(0.0)
        return torch.matmul(p.to(dt), v.to(dt)).reshape(b, hq, d).double()

    want = attend(torch.float64)
    err = (got.double() - want).abs().max().item()
    err_bf16 = (attend(torch.bfloat16) - want).abs().max().item()
    print(f"\n  kernel err {err:.3e}, BF16 PyTorch err {err_bf16:.3e}")
    assert err <= 2 * err_bf16 + 1e-5, f"max error {err:.3e} > 2 x BF16 error {err_bf16:.3e} + 1e-5"


@pytest.mark.parametrize("gran", ["token", "channel"])
@pytest.mark.parametrize("variant", [{}, dict(page_slots=4, num_warps=4), dict(page_slots=1, num_warps=1)],
                         ids=["default", "slots4", "slots1"])
def test_decode_attention_real_shape(gran, variant):
    """The split kernel (pages on a batch axis, scaled-subnormal fields: needs the tensor cores to take fp16
    subnormals exactly) within budget at the real shape, at the default and two other page-slot counts."""
    lay = KVCacheLayout.default(8, 128, gran)
    tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
    lengths = [33000, 8192, 385, 17]
    torch.manual_seed(0)
    st = _random_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), 32, 128, device=DEV)
    got = decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 128**-0.5, **variant)
    _budget(got, q, st, lay, tr, 128**-0.5)


def test_decode_step_cuda_graph_equals_eager():
    """append (+ demotion when due) + attention, captured once and replayed across a demotion boundary."""
    lay = KVCacheLayout.default(8, 128, "channel")
    tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
    lengths = [lay.sink + lay.recent_capacity - 2, 1000, 70]  # sequence 0 demotes at the third step
    eager = _random_cache(lay, lengths, tr)
    # reserve the next page ids in the block tables (the graph cannot allocate)
    mp = eager.block_table.shape[1]
    for b in range(len(lengths)):
        n = int(eager.num_pages[b])
        eager.block_table[b, n:] = torch.arange(1000 + b * mp, 1000 + b * mp + mp - n, dtype=torch.int32)
    grow = lambda t: torch.cat([t, torch.zeros(2000 + 3 * mp - t.shape[0], *t.shape[1:], dtype=t.dtype, device=DEV)])  # noqa: E731
    for f in ("k_codes", "k_params", "v_codes", "v_params"):
        setattr(eager, f, grow(getattr(eager, f)))
    graph_st = PagedKV(**{f: getattr(eager, f).clone() for f in eager.__dataclass_fields__})
    steps = 5
    ks = torch.randn(steps, 3, 8, 128, device=DEV)
    vs = torch.randn(steps, 3, 8, 128, device=DEV)
    qs = torch.randn(steps, 3, 32, 128, device=DEV)
    k_in, v_in, q_in = ks[0].clone(), vs[0].clone(), qs[0].clone()

    def step(st):
        decode_step_update(st, k_in, v_in, lay, tr)
        return decode_attention(q_in, st, lay, tr.k_levels, tr.v_levels, 128**-0.5, out_dtype=torch.bfloat16)

    snapshot = PagedKV(**{f: getattr(graph_st, f).clone() for f in graph_st.__dataclass_fields__})
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(graph_st)  # warm-up (compiles), then undo it
    torch.cuda.current_stream().wait_stream(s)
    for f in graph_st.__dataclass_fields__:
        getattr(graph_st, f).copy_(getattr(snapshot, f))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_static = step(graph_st)
    for f in graph_st.__dataclass_fields__:  # capture does not run the kernels, but be explicit
        getattr(graph_st, f).copy_(getattr(snapshot, f))
    for i in range(steps):
        k_in.copy_(ks[i]); v_in.copy_(vs[i]); q_in.copy_(qs[i])  # noqa: E702
        g.replay()
        want = step(eager)
        assert torch.equal(out_static, want), f"step {i}: graph output differs from eager"
    assert int(eager.num_pages[0]) == int(snapshot.num_pages[0]) + 1, "the replay should have crossed a demotion"
    for f in eager.__dataclass_fields__:
        assert torch.equal(getattr(graph_st, f), getattr(eager, f)), f"state.{f} differs after graph replays"


def test_custom_ops_under_torch_compile():
    """``oscar::decode_step_update`` + ``oscar::decode_attention`` in ``torch.compile(fullgraph=True)`` == eager."""
    from oscar_export.kernels import triton_ops

    lay = KVCacheLayout.default(8, 128, "token")
    tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
    eager = _random_cache(lay, [5000, lay.sink + lay.recent_capacity], tr)  # sequence 1 demotes at once
    pool = eager.k_codes.shape[0]
    for f in ("k_codes", "k_params", "v_codes", "v_params"):  # two spare pages, reserved in the block tables
        t = getattr(eager, f)
        setattr(eager, f, torch.cat([t, torch.zeros(2, *t.shape[1:], dtype=t.dtype, device=DEV)]))
    for b in range(2):
        eager.block_table[b, int(eager.num_pages[b])] = pool + b
    comp = PagedKV(**{f: getattr(eager, f).clone() for f in eager.__dataclass_fields__})
    k, v = (torch.randn(2, 8, 128, device=DEV) for _ in range(2))
    q = torch.randn(2, 32, 128, device=DEV)

    def step(st, k, v, q):
        triton_ops.decode_step_update(st, k, v, lay, tr)
        return triton_ops.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 128**-0.5, pages_per_split=4)

    want = step(eager, k, v, q)
    got = torch.compile(step, fullgraph=True)(comp, k, v, q)
    assert torch.equal(got, want)
    for f in eager.__dataclass_fields__:
        assert torch.equal(getattr(comp, f), getattr(eager, f)), f"state.{f} differs"


def test_hf_triton_backend_matches_reference_ops():
    """``backend="triton"``: prefill writes bit-exact, decode within the error budget (windows BF16)."""
    from oscar_export.plugins.hf.triton_backend import triton_ops

    ops = triton_ops()
    lay = KVCacheLayout.default(8, 128, "channel")
    tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
    a = PagedKV.allocate(lay, 2, 64, 32, device=DEV)
    g = PagedKV(**{f: getattr(a, f).clone() for f in a.__dataclass_fields__})
    for b, t in enumerate([3000, 700]):
        k, v = torch.randn(8, t, 128, device=DEV), torch.randn(8, t, 128, device=DEV)
        ia, ig = iter(range(b * 32, b * 32 + 32)), iter(range(b * 32, b * 32 + 32))
        ref.append_tokens(a, b, k, v, lay, tr, lambda: next(ia))
        ops.append_tokens(g, b, k, v, lay, tr, lambda: next(ig))
    for f in a.__dataclass_fields__:
        assert torch.equal(getattr(g, f), getattr(a, f)), f"state.{f} differs"
    q = torch.randn(2, 32, 128, device=DEV)
    _budget(ops.decode_attention(q, g, lay, tr.k_levels, tr.v_levels, 128**-0.5), q, a, lay, tr, 128**-0.5)
