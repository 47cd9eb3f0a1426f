"""The Triton kernels at real shapes on a CUDA GPU (run on the H200; skipped without CUDA).

    python -m pytest tests/gpu/test_kernels_gpu.py -m gpu -s

Checks: quantize/pack bit-exact against the reference (computed on the same GPU) at a prefill's size, both
key granularities; decode attention (32 query / 8 KV heads, head_dim 128, sequences up to 33K tokens) within
the error budget (<= 2x a BF16 PyTorch computation's error against fp64, + 1e-5); a decode step (append,
demotion when due, attention) captured in a CUDA graph and replayed across a demotion, equal to eager;
head_dim 256 with two groups of 128 per row (Gemma-3-12B/27B heads): decode attention within the budget (plain
and fused query rotation), quantize and decode_append bit-exact; 4-bit key pages (Llama-3-8B and Gemma-3-12B
heads): decode attention within the budget (PTX and plain nibble extraction, fused rotation), quantize and
decode_append bit-exact.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

triton = pytest.importorskip("triton")

from oscar_export.kernels import reference as ref  # noqa: E402
from oscar_export.kernels.decode.portable import decode_attention  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout, PagedKV  # noqa: E402
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
    return err, err_bf16


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


#: Gemma-3 shapes (query heads, KV heads) at head_dim 256: 12B (16 / 8) and 27B (32 / 16).
GEMMA3_HEADS = [(16, 8), (32, 16)]


@pytest.mark.parametrize("gran", ["token", "channel"])
@pytest.mark.parametrize("hq,hkv", GEMMA3_HEADS, ids=["gemma3-12b", "gemma3-27b"])
@pytest.mark.parametrize("variant", [{}, dict(page_slots=1, num_warps=1)], ids=["default", "slots1"])
def test_decode_attention_head_dim_256_two_groups(hq, hkv, variant, gran):
    """head_dim 256 with two groups of 128 per row (Gemma 3's default layout, P = 128), token or channel keys,
    within budget (queries rotated once, as the serving step does)."""
    lay = KVCacheLayout.default(hkv, 256, gran)
    assert (lay.key.group_size, lay.page_size) == (128, 128)
    tr = _rotated(hkv, 256)
    lengths = [16500, 4096, 449, 17]
    torch.manual_seed(0)
    st = _random_cache(lay, lengths, tr)
    q_model = torch.randn(len(lengths), hq, 256, device=DEV)
    q = tr.transform_queries(q_model[:, :, None]).squeeze(2).contiguous()
    got = decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 256**-0.5, **variant)
    _budget(got, q, st, lay, tr, 256**-0.5)


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_decode_append_and_quantize_head_dim_256_bit_exact(gran):
    """head_dim 256, G 128: the prefill quantizer and the decode step's writer (token + demotion) leave every
    buffer equal to the reference's on the GPU."""
    lay = KVCacheLayout.default(8, 256, gran, sink=16, window=128)
    tr = LayerTransform.identity(8, 256, 0.96, 0.92).to(DEV)
    x = (torch.randn(64, 8, lay.page_size, 256, device=DEV) * 2).bfloat16().float()
    for name, g, w in zip(("codes", "params"), quantize_pages(x, lay, lay.key, tr.k_clip, tr.k_levels),
                          ref.quantize_pages(x, lay.key, tr.k_clip, tr.k_levels)):
        assert torch.equal(g, w), f"quantize {gran} keys {name}: {(g != w).sum().item()} mismatches"
    _assert_four_steps_equal_reference(lay, tr, gran)


def _assert_four_steps_equal_reference(lay: KVCacheLayout, tr: LayerTransform, label: str) -> None:
    """Four decode steps over ragged lengths (slot 0 demotes at the first step) by ``reference.decode_append`` and by
    the kernel's, on two caches booked alike: a demotion crossed and every cache tensor equal (``label`` names a
    failure)."""
    from oscar_export.kernels.decode_step import decode_append

    lengths = [lay.sink + lay.recent_capacity - 1, 700, 5]  # slot 0 demotes at the first step
    books, states = [], []
    for _ in range(2):
        torch.manual_seed(0)
        book, st = _book_cache(lay, lengths, tr, 1200)
        books.append(book)
        states.append(st)
    ks, vs = torch.randn(4, 3, 8, lay.head_dim, device=DEV), torch.randn(4, 3, 8, lay.head_dim, device=DEV)
    for i in range(4):
        for book, st, fn in ((books[0], states[0], ref.decode_append), (books[1], states[1], decode_append)):
            book.begin(1)
            fn(book.state_view(st, book.committed), ks[i].bfloat16(), vs[i].bfloat16(), book.status, lay, tr)
            book.commit(1)
    assert int(books[0].committed.num_pages[0]) == lay.pages_for(lengths[0] + 4) >= 1, "no demotion crossed"
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        g, w = getattr(states[1], f), getattr(states[0], f)
        assert torch.equal(g, w), f"decode_append {label} {f}: {(g != w).sum().item()} mismatches"


def _book_cache(lay: KVCacheLayout, lengths: list[int], tr: LayerTransform, max_length: int):
    """A page book (pages reserved per slot) and its state filled through the reference writer on the GPU."""
    from oscar_export.kernels.pages import PageBook

    book = PageBook(lay, len(lengths), max_length, DEV)
    st = book.state_view(PagedKV.allocate(lay, len(lengths), book.num_pool_pages, book.max_pages, device=DEV),
                         book.committed)
    for b, t in enumerate(lengths):
        k = torch.randn(lay.num_kv_heads, t, lay.head_dim, device=DEV)
        k = k * torch.linspace(0.2, 2, lay.head_dim, device=DEV)
        ref.write_tokens(st, b, 0, k, torch.randn_like(k), lay, tr)
    book.seq_len.copy_(torch.tensor(lengths, dtype=torch.int32))
    book.commit(0)
    return book, st


def _rotated(h: int, d: int) -> LayerTransform:
    from dataclasses import replace

    g = torch.Generator().manual_seed(0)
    base = LayerTransform.identity(h, d, 0.96, 0.92)
    return replace(base, k_rotation=torch.linalg.qr(torch.randn(h, d, d, generator=g))[0].contiguous(),
                   k_scale=0.5 + torch.rand(h, d, generator=g), k_mean=0.1 * torch.randn(h, d, generator=g),
                   v_mean=0.1 * torch.randn(h, d, generator=g)).to(DEV)


def test_decode_step_cuda_graph_equals_eager():
    """begin + append (key transform fused, demotion when due) + attention (query rotation fused) + commit,
    captured once and replayed across a demotion boundary and a NaN step: outputs and every buffer == eager."""
    from oscar_export.kernels.decode_step import decode_append

    lay = KVCacheLayout.default(8, 128, "channel")
    tr = _rotated(8, 128)
    lengths = [lay.sink + lay.recent_capacity - 2, 1000, 70]  # slot 0 demotes at the third step
    torch.manual_seed(0)
    eager_book, eager = _book_cache(lay, lengths, tr, 1200)
    graph_book, graph_st = _book_cache(lay, [0, 0, 0], tr, 1200)
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        getattr(graph_st, f).copy_(getattr(eager, f))
    graph_book.seq_len.copy_(eager_book.seq_len)
    graph_book.commit(0)
    steps = 6
    ks, vs = torch.randn(steps, 3, 8, 128, device=DEV), torch.randn(steps, 3, 8, 128, device=DEV)
    ks[4, 1, 3, 5] = float("nan")  # step 4: slot 1 is not committed
    qs = torch.randn(steps, 3, 32, 128, device=DEV)
    k_in, v_in, q_in = ks[0].clone(), vs[0].clone(), qs[0].clone()

    def step(book, st, k, v, q):
        book.begin(1)
        q_s = decode_append(book.state_view(st, book.committed), k, v, book.status, lay, tr, fused_transform=True,
                            q=q)
        book.commit(1)
        return decode_attention(q_s, book.state_view(st, book.in_step), lay, tr.k_levels, tr.v_levels, 128**-0.5,
                                out_dtype=torch.bfloat16)

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles the kernels; its effect is undone below
        snap = [t.clone() for t in graph_book.tensors()]
        step(graph_book, graph_st, k_in, v_in, q_in)
        for t, c in zip(graph_book.tensors(), snap):
            t.copy_(c)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out_static = step(graph_book, graph_st, k_in, v_in, q_in)
    for i in range(steps):
        k_in.copy_(ks[i]); v_in.copy_(vs[i]); q_in.copy_(qs[i])  # noqa: E702
        g.replay()
        want = step(eager_book, eager, ks[i], vs[i], qs[i])
        assert torch.equal(out_static, want), f"step {i}: graph output differs from eager"
        assert torch.equal(graph_book.status, eager_book.status), f"step {i}: status differs"
    assert eager_book.seq_len.tolist() == [lengths[0] + steps, lengths[1] + steps - 1, lengths[2] + steps]
    assert int(eager_book.committed.num_pages[0]) == lay.pages_for(lengths[0] + steps) >= 1, "no demotion crossed"
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        assert torch.equal(getattr(graph_st, f), getattr(eager, f)), f"state.{f} differs after graph replays"
    assert torch.equal(graph_book.seq_len, eager_book.seq_len)


def test_custom_ops_under_torch_compile():
    """``oscar::decode_append`` (rotating the step's queries) + ``oscar::decode_attention`` on what it
    returned, in ``torch.compile(fullgraph=True)`` == eager; the returned queries == the append wrapper's."""
    from oscar_export.kernels import triton_ops
    from oscar_export.kernels.decode_step import rotate_queries

    lay = KVCacheLayout.default(8, 128, "token")
    tr = _rotated(8, 128)
    torch.manual_seed(1)
    lengths = [5000, lay.sink + lay.recent_capacity]  # slot 1 demotes at once
    eb, eager = _book_cache(lay, lengths, tr, 6000)
    cb, comp = _book_cache(lay, [0, 0], tr, 6000)
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        getattr(comp, f).copy_(getattr(eager, f))
    cb.seq_len.copy_(eb.seq_len)
    cb.commit(0)
    k, v = (torch.randn(2, 8, 128, device=DEV) for _ in range(2))
    q = torch.randn(2, 32, 128, device=DEV)

    def step(book, st, k, v, q):
        book.begin(1)
        q_s = triton_ops.decode_append(book.state_view(st, book.committed), k, v, book.status, lay, tr,
                                       fused_transform=True, q=q)
        book.commit(1)
        out = triton_ops.decode_attention(q_s, book.state_view(st, book.in_step), lay, tr.k_levels, tr.v_levels,
                                          128**-0.5, pages_per_split=4)
        return out, q_s

    want, want_q = step(eb, eager, k, v, q)
    got, got_q = torch.compile(step, fullgraph=True)(cb, comp, k, v, q)
    assert torch.equal(got, want) and torch.equal(got_q, want_q)
    torch.testing.assert_close(want_q, rotate_queries(q, tr), rtol=1e-5, atol=1e-4)  # fp32 FMA order
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        assert torch.equal(getattr(comp, f), getattr(eager, f)), f"state.{f} differs"
    assert int(eb.committed.num_pages[1]) == 1


def test_hf_triton_backend_matches_reference_ops():
    """``backend="triton"``: prompt writes bit-exact with the reference, decode within the error budget."""
    from types import SimpleNamespace

    from oscar_export.plugins.hf.cache import TransformFlags
    from oscar_export.plugins.hf.ops import get_ops

    ops = get_ops("triton")
    lay = KVCacheLayout.default(8, 128, "channel")
    tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
    torch.manual_seed(2)
    _, a = _book_cache(lay, [0, 0], tr, 4000)
    _, g = _book_cache(lay, [0, 0], tr, 4000)
    layer = SimpleNamespace(layout=lay, transform=tr, flags=TransformFlags.of(tr), pages_per_split=None,
                            decode_variant=None)
    for b, t in enumerate([3000, 700]):
        k, v = torch.randn(8, t, 128, device=DEV), torch.randn(8, t, 128, device=DEV)
        ref.write_tokens(a, b, 0, k, v, lay, tr)
        ops.write_planned(layer, g, ref.plan_writes(lay, [(b, 0, t)], g.block_table.shape[1], DEV), k, v)
        for st in (a, g):
            st.sink_len[b], st.num_pages[b], st.recent_len[b] = lay.split(t)
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        assert torch.equal(getattr(g, f), getattr(a, f)), f"state.{f} differs"
    q = torch.randn(2, 32, 128, device=DEV)
    _budget(ops.decode_attention(layer, q, g, 128**-0.5), q, a, lay, tr, 128**-0.5)


# ---- mma16 pages (the hopper backend: kernels/decode/hopper.py) ------------------------------------------------
# Written on a CPU machine; the fragment test needs CuPy (NVRTC) on the GPU machine. Untested until run there.

_FRAG_SRC = r"""
extern "C" __global__ void frag_mma(const unsigned int* words, const unsigned short* b, float* out, int C, int MB) {
    // one warp per 16*MB-row group mo; out [R, 8] = (codes + 1024) @ B, B [C, 8] fp16 row-major (bit patterns)
    const int lane = threadIdx.x, g = lane >> 2, tq = lane & 3, mo = blockIdx.x, W = C / 32;
    const unsigned int* mine = words + (mo * 32 + lane) * MB * W;  // this lane's MB * W words, contiguous
    unsigned int reg[8];
    if (MB * W == 4) {  // the 16-byte load per thread
        uint4 v = *reinterpret_cast<const uint4*>(mine);
        reg[0] = v.x; reg[1] = v.y; reg[2] = v.z; reg[3] = v.w;
    } else {
        for (int i = 0; i < MB * W && i < 8; ++i) reg[i] = mine[i];
    }
    for (int mi = 0; mi < MB; ++mi) {
        float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
        for (int w = 0; w < W; ++w) {
            unsigned int word = reg[mi * W + w];
            for (int kb = 0; kb < 2; ++kb) {
                unsigned int a[4];
                for (int r = 0; r < 4; ++r)  // field k = 4kb + r -> fp16x2 (1024 + c_lo, 1024 + c_hi)
                    a[r] = ((word >> (2 * (4 * kb + r))) & 0x00030003u) | 0x64006400u;
                const int k0 = 16 * (2 * w + kb) + 2 * tq;
                unsigned int b0 = b[(k0) * 8 + g] | ((unsigned int)b[(k0 + 1) * 8 + g] << 16);
                unsigned int b1 = b[(k0 + 8) * 8 + g] | ((unsigned int)b[(k0 + 9) * 8 + g] << 16);
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                             "{%8,%9}, {%0,%1,%2,%3};"
                             : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
            }
        }
        const int row = 16 * (mo * MB + mi) + g;
        out[row * 8 + 2 * tq] = c0; out[row * 8 + 2 * tq + 1] = c1;
        out[(row + 8) * 8 + 2 * tq] = c2; out[(row + 8) * 8 + 2 * tq + 1] = c3;
    }
}
"""


@pytest.mark.parametrize("rows,cols", [(64, 128), (128, 64), (16, 32)], ids=["K-P64-D128", "V-D128-P64", "tiny"])
def test_mma16_fragment_mapping_with_mma_sync(rows, cols):
    """The mma16 bytes of a ``[rows, cols]`` code matrix, loaded 16 bytes per lane and turned into fp16x2 by one
    ``and`` + ``or 0x64006400`` per register, fed to ``mma.sync.m16n8k16`` as the A operand, give exactly
    ``(codes + 1024) @ B``: the hardware reads the fragments where ``reference.pack_mma16`` says they are."""
    cp = pytest.importorskip("cupy")
    torch.manual_seed(0)
    codes = torch.randint(0, 4, (rows, cols), dtype=torch.uint8)
    words = ref.pack_mma16(codes).view(torch.int32).cuda()
    bmat = torch.randint(-2, 3, (cols, 8)).to(torch.float16)
    out = torch.zeros(rows, 8, dtype=torch.float32, device=DEV)
    kern = cp.RawKernel(_FRAG_SRC, "frag_mma", options=("--std=c++17",))
    mb = ref.mma16_group(rows, cols)
    bits = bmat.view(torch.int16).cuda()
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        kern((rows // (16 * mb),), (32,), (cp.asarray(words), cp.asarray(bits), cp.asarray(out), cp.int32(cols),
                                           cp.int32(mb)))
    torch.cuda.synchronize()
    want = (codes.double() + 1024) @ bmat.double()  # small integers: exact in fp32
    assert torch.equal(out.cpu().double(), want), f"{(out.cpu().double() != want).sum().item()} outputs differ"


def _mma16_layout(gran: str, p: int = 64) -> KVCacheLayout:
    from dataclasses import replace

    lay = KVCacheLayout.default(8, 128, gran, page_size=p)
    return replace(lay, key=replace(lay.key, packing="mma16"), value=replace(lay.value, packing="mma16"))


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_quantize_mma16_real_shape_bit_exact(gran):
    """Prefill pages written in mma16 order (keys and values) bit-exact with the reference on the GPU."""
    lay = _mma16_layout(gran)
    x = (torch.randn(512, 8, 64, 128, device=DEV) * torch.linspace(0.1, 3, 128, device=DEV)).bfloat16().float()
    clip = torch.tensor([1.0, 0.99, 0.96, 0.92, 0.9, 0.8, 0.7, 0.5], device=DEV)
    levels = torch.tensor([0.0, 1.0, 2.0, 3.0], device=DEV).repeat(8, 1)
    for operand, fmt in (("key", lay.key), ("value", lay.value)):
        want = ref.quantize_pages(x, fmt, clip, levels, operand)
        got = quantize_pages(x, lay, fmt, clip, levels, operand=operand)
        for name, g, w in zip(("codes", "params"), got, want):
            mism = (g != w).sum().item()
            assert mism == 0, f"{gran} {operand} {name}: {mism} mismatches, first at {(g != w).nonzero()[:3].tolist()}"


def _hopper():
    from oscar_export.kernels.decode import hopper

    return hopper


def _linear_copy(st: PagedKV, lay: KVCacheLayout) -> tuple[PagedKV, KVCacheLayout]:
    """The same pages in linear order (the reference repacks the codes): the portable kernel's input."""
    from dataclasses import replace

    lin = lay.with_packing("linear")
    codes = {}
    for name, fmt, lfmt, operand in (("k_codes", lay.key, lin.key, "key"), ("v_codes", lay.value, lin.value, "value")):
        codes[name] = ref.pack_page_codes(ref.unpack_page_codes(getattr(st, name), fmt, operand), lfmt, operand)
    return replace(st, **codes), lin


@pytest.mark.parametrize("key_bits", [2, 4])
@pytest.mark.parametrize("p", [128, 64])
@pytest.mark.parametrize("gran", ["token", "channel"])
def test_decode_attention_gluon_real_shape_vs_budget_and_portable(gran, p, key_bits):
    """The Hopper (Gluon) kernel within budget at the Llama-3-8B shape (32 / 8 heads, D 128) on 2- and 4-bit key
    pages of 128 and 64 tokens, close to the portable kernel on the same pages in linear order; pages per split 1
    (prologue only), 3 (a partial last split) and the plan's; model-basis BF16 queries rotated once a step
    (``decode_step.rotate_queries``) within budget."""
    from oscar_export.kernels.decode_step import rotate_queries

    hopper = _hopper()
    lay = _mma16_layout(gran, p).with_key_bits(key_bits)
    tr = _fitted_rotated_transform_gpu(8, 128)
    lengths = [33000, 8192, 385, 17, 0]
    torch.manual_seed(3)
    st = _random_cache(lay, lengths, tr)
    assert key_bits == 2 or int(ref.unpack_page_codes(st.k_codes, lay.key, "key").max()) == 15
    st_lin, lin = _linear_copy(st, lay)
    q = torch.randn(len(lengths), 32, 128, device=DEV)
    for pps in (None, 1, 3):
        got = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 128**-0.5, pages_per_split=pps)
        assert torch.equal(got[4], torch.zeros_like(got[4])), "an empty sequence must give zeros"
        e3, _ = _budget(got, q, st, lay, tr, 128**-0.5)
        want = decode_attention(q, st_lin, lin, tr.k_levels, tr.v_levels, 128**-0.5)
        e1, _ = _budget(want, q, st_lin, lin, tr, 128**-0.5)
        diff = (got - want).abs().max().item()
        print(f"\n  hopper {gran} p={p} k{key_bits} pps={pps}: err {e3:.3e}, portable err {e1:.3e}, |diff| {diff:.3e}")
        assert diff <= e1 + e3 + 1e-6, (diff, e1, e3)
    q_model = torch.randn(len(lengths), 32, 128, device=DEV).bfloat16()
    once = hopper.decode_attention(rotate_queries(q_model, tr), st, lay, tr.k_levels, tr.v_levels, 128**-0.5)
    _budget(once, rotate_queries(q_model, tr), st, lay, tr, 128**-0.5)


def _fitted_rotated_transform_gpu(hkv: int, d: int) -> LayerTransform:
    """An identity transform but for a random key rotation and uneven key scales (uniform levels: the Gluon
    kernel's)."""
    ident = LayerTransform.identity(hkv, d, 0.96, 0.92)
    rot = torch.linalg.qr(torch.randn(hkv, d, d))[0].contiguous()
    return LayerTransform(
        k_rotation=rot, v_rotation=ident.v_rotation, k_scale=torch.rand(hkv, d) + 0.5, v_scale=ident.v_scale,
        k_mean=ident.k_mean, v_mean=ident.v_mean, k_clip=ident.k_clip, v_clip=ident.v_clip,
        k_levels=ident.k_levels, v_levels=ident.v_levels,
    ).to(DEV)


@pytest.mark.parametrize("key_bits", [2, 4])
@pytest.mark.parametrize("hq,d,p", [(64, 256, 128), (128, 128, 64), (24, 64, 64)])
def test_decode_attention_gluon_head_dims_and_gqa(hq, d, p, key_bits):
    """Head dims 256 (two key chunks) and 64, 16 and 3 query heads per KV head (N = 16 and 8), 2- and 4-bit keys,
    within budget; the query rotation of the append launch (once a step) equal to the host's float64 one up to
    fp32 rounding, and the kernel fed with it within budget."""
    from oscar_export.kernels.decode_step import decode_append
    from oscar_export.kernels.layout import RowFormat

    hopper = _hopper()
    # one group per row (the kernel's token keys need it: the default layout has two groups of 128 at D = 256)
    lay = KVCacheLayout(8, d, RowFormat(d, d, "token", packing="mma16"), RowFormat(d, d, packing="mma16"),
                        page_size=p).with_key_bits(key_bits)
    tr = LayerTransform.identity(8, d, 0.96, 0.92).to(DEV)
    lengths = [9000, 700]
    torch.manual_seed(4)
    st = _random_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), hq, d, device=DEV)
    got = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, d**-0.5)
    _budget(got, q, st, lay, tr, d**-0.5)
    rot = _fitted_rotated_transform_gpu(8, d)
    gq = hq // 8
    q_model = torch.randn(len(lengths), hq, d, device=DEV).bfloat16()
    q_stored = torch.einsum("bkgd,kde->bkge", q_model.double().view(len(lengths), 8, gq, d),
                            rot.k_rotation.double()) / rot.k_scale.double()[None, :, None, :]
    # the append launch's rotation, on a scratch cache of the same layout (the rows it writes are not read here)
    scratch = PagedKV.allocate(lay, len(lengths), 4, 2, device=DEV)
    kv = torch.randn(len(lengths), 8, d, device=DEV)
    q_once = decode_append(scratch, kv, kv, torch.zeros(len(lengths), dtype=torch.int32, device=DEV), lay, rot,
                           fused_transform=True, q=q_model)
    assert (q_once.double() - q_stored.reshape(q_once.shape)).abs().max().item() < 1e-4 * q_stored.abs().max().item()
    once = hopper.decode_attention(q_once, st, lay, tr.k_levels, tr.v_levels, d**-0.5)
    _budget(once, q_once, st, lay, tr, d**-0.5)


@pytest.mark.parametrize("key_bits", [2, 4])
def test_decode_attention_gluon_matches_its_emulation(key_bits):
    """The kernel against hopper_emulation.emulate (its own arithmetic in float64 on the CPU, one softmax
    instead of split + merge): a wrong operand bit or scale folding moves outputs of magnitude ~1 by O(0.1);
    the different fp16 roundings of ``p·s_v`` (running vs global max) by ~1e-3."""
    from oscar_export.kernels.decode import hopper_emulation as gla

    lay = _mma16_layout("token", 128).with_key_bits(key_bits)
    tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
    torch.manual_seed(5)
    st = _random_cache(lay, [2000, 130], tr)
    q = torch.randn(2, 32, 128, device=DEV)
    got = _hopper().decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 128**-0.5).cpu()
    cpu = PagedKV(**{f: getattr(st, f).cpu() for f in st.__dataclass_fields__})
    want = gla.emulate(q.cpu(), cpu, lay, 128**-0.5)
    assert (got - want).abs().max().item() < 1e-2, (got - want).abs().max().item()


def test_decode_attention_gluon_cuda_graph_equals_eager():
    hopper = _hopper()
    lay = _mma16_layout("token", 128)
    tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
    torch.manual_seed(6)
    st = _random_cache(lay, [8192, 300], tr)
    q = torch.randn(2, 32, 128, device=DEV)
    eager = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 128**-0.5)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 128**-0.5)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("gran,hq,d,p,key_bits", [("token", 32, 128, 128, 2), ("channel", 32, 128, 64, 2),
                                                  ("token", 24, 64, 64, 2), ("token", 128, 256, 128, 2),
                                                  ("channel", 32, 128, 128, 4)])
def test_decode_attention_gluon_fused_merge_equals_two_launches(gran, hq, d, p, key_bits):
    """The merge in each (sequence, KV head)'s last program against split + decode_merge of the same kernel: equal
    up to the summation order (fp32 outputs), at 1 page a split (the most programs racing to be last) and the
    plan's; deterministic over repeated launches; a CUDA graph's replays
    equal eager; empty sequences zeros; every counter back at zero afterwards."""
    from oscar_export.kernels.layout import RowFormat

    hopper = _hopper()
    lay = KVCacheLayout(8, d, RowFormat(d, d, gran, packing="mma16"), RowFormat(d, d, packing="mma16"),
                        page_size=p).with_key_bits(key_bits)
    tr = _fitted_rotated_transform_gpu(8, d)
    lengths = [33000, 8192, 385, 0, 17]
    torch.manual_seed(7)
    st = _random_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), hq, d, device=DEV)
    for pps in (None, 1):
        kw = dict(pages_per_split=pps)
        want = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, d**-0.5, fused_merge=False, **kw)
        got = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, d**-0.5, fused_merge=True, **kw)
        diff = (got - want).abs().max().item()
        print(f"\n  fused merge {gran} hq={hq} d={d} p={p} k{key_bits} pps={pps}: |fused - two| {diff:.2e}")
        assert diff <= 1e-5 * want.abs().max().item(), diff
        assert torch.equal(got[3], torch.zeros_like(got[3])), "an empty sequence must give zeros"
        for _ in range(5):
            again = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, d**-0.5, fused_merge=True, **kw)
            assert torch.equal(again, got), "the merge must not depend on which program is last"
    assert not hopper.merge_counters(q.device, 1).any(), "every counter back at zero"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, d**-0.5, fused_merge=True)
    eager = hopper.decode_attention(q, st, lay, tr.k_levels, tr.v_levels, d**-0.5, fused_merge=True)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert not hopper.merge_counters(q.device, 1).any()


def test_decode_attention_gluon_fused_merge_refuses_first_use_in_a_capture(monkeypatch):
    """The counters' zero fill must run: their first allocation inside a CUDA-graph capture is refused."""
    hopper = _hopper()
    monkeypatch.setattr(hopper, "_COUNTERS", {})
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="must run eagerly"):
        with torch.cuda.graph(g):
            hopper.merge_counters(torch.device(DEV), 8)


@pytest.mark.parametrize("key_bits", [2, 4])
@pytest.mark.parametrize("gran", ["token", "channel"])
def test_decode_attention_gluon_two_groups_head_dim_256(gran, key_bits):
    """Gemma-3-12B's heads (16 / 8, head_dim 256) on the default layout, two token groups of 128 a row (the
    kernel's ``NG = 2``: each key chunk scaled by its group, each half of the value dims by its group's ``p·s_v``):
    within budget and close to the portable kernel on the same pages in linear order. Launched through
    ``hopper.launch`` (its pass on the H200 let ``checks.check_hopper_layout`` accept two groups a row)."""
    from oscar_export.kernels.checks import check_hopper_layout

    hopper = _hopper()
    lay = KVCacheLayout.default(8, 256, gran, page_size=128, packing="mma16").with_key_bits(key_bits)
    check_hopper_layout(lay, 16)
    tr = _fitted_rotated_transform_gpu(8, 256)
    lengths = [16500, 449, 17]
    torch.manual_seed(8)
    st = _random_cache(lay, lengths, tr)
    st_lin, lin = _linear_copy(st, lay)
    q = torch.randn(len(lengths), 16, 256, device=DEV)
    pps = hopper.pages_per_split(len(lengths), 8, st.block_table.shape[1], q.device, 256)
    got = hopper.launch(q, st.sink_k, st.sink_v, st.recent_k, st.recent_v, st.k_codes, st.k_params, st.v_codes,
                        st.v_params, tr.k_levels, tr.v_levels, st.block_table, st.sink_len, st.num_pages,
                        st.recent_len, 8, lay.page_size, lay.sink, lay.recent_slots, 256**-0.5,
                        gran == "channel", pps, torch.float32)
    e_g, _ = _budget(got, q, st, lay, tr, 256**-0.5)
    want = decode_attention(q, st_lin, lin, tr.k_levels, tr.v_levels, 256**-0.5)
    e_p, _ = _budget(want, q, st_lin, lin, tr, 256**-0.5)
    diff = (got - want).abs().max().item()
    print(f"  two groups {gran} k{key_bits}: err {e_g:.3e}, portable err {e_p:.3e}, |diff| {diff:.3e}")
    assert diff <= e_g + e_p + 1e-6, (diff, e_g, e_p)


def test_decode_append_4bit_mma16_keys_on_gpu_equals_reference():
    """The decode-step demotion writes 4-bit mma16 key pages equal to the reference's on the GPU (real shape),
    both key granularities, and the prefill quantizer too."""
    for gran in ("token", "channel"):
        lay = _mma16_layout(gran).with_key_bits(4)
        tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
        x = (torch.randn(64, 8, 64, 128, device=DEV) * torch.linspace(0.1, 3, 128, device=DEV)).bfloat16().float()
        for name, g, w in zip(("codes", "params"), quantize_pages(x, lay, lay.key, tr.k_clip, tr.k_levels),
                              ref.quantize_pages(x, lay.key, tr.k_clip, tr.k_levels)):
            assert torch.equal(g, w), f"quantize 4-bit mma16 {gran} keys {name}: {(g != w).sum().item()} mismatches"
        _assert_demotion_equals_reference(lay, tr, f"4-bit mma16 {gran}: ")


def test_decode_append_mma16_on_gpu_equals_reference():
    """The decode-step demotion writes mma16 pages equal to the reference's on the GPU (real shape)."""
    lay = _mma16_layout("channel")
    tr = LayerTransform.identity(8, 128, 0.96, 0.92).to(DEV)
    _assert_demotion_equals_reference(lay, tr)


def _assert_demotion_equals_reference(lay: KVCacheLayout, tr: LayerTransform, label: str = "") -> None:
    """One decode step in which slot 0 demotes a page, by ``reference.decode_append`` and by the kernel's on copies of
    one booked cache: every cache tensor equal (``label`` starts the failure message)."""
    from oscar_export.kernels.decode_step import decode_append

    lengths = [lay.sink + lay.recent_capacity, lay.sink + lay.recent_capacity - 1, 2000]  # slot 0 demotes
    torch.manual_seed(2)
    book_r, st_r = _book_cache(lay, lengths, tr, 2500)
    book_g, st_g = _book_cache(lay, [0, 0, 0], tr, 2500)
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        getattr(st_g, f).copy_(getattr(st_r, f))
    book_g.seq_len.copy_(book_r.seq_len)
    book_g.commit(0)
    k, v = torch.randn(3, 8, 128, device=DEV), torch.randn(3, 8, 128, device=DEV)
    for book, st, fn in ((book_r, st_r, ref.decode_append), (book_g, st_g, decode_append)):
        book.begin(1)
        fn(book.state_view(st, book.committed), k, v, book.status, lay, tr)
        book.commit(1)
    assert int(book_r.committed.num_pages[0]) == 1
    for f in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params"):
        assert torch.equal(getattr(st_g, f), getattr(st_r, f)), f"{label}state.{f} differs"


# ---- 4-bit key pages (layout.with_key_bits(4)): values stay 2-bit -----------------------------------------------


@pytest.mark.parametrize("gran", ["token", "channel"])
@pytest.mark.parametrize("variant", [{}, dict(page_slots=1, num_warps=1), dict(fast_unpack=False)],
                         ids=["default", "slots1", "plain"])
def test_decode_attention_4bit_keys_real_shape(gran, variant):
    """Llama-3-8B's shape (32 / 8 heads, head_dim 128) with 4-bit key pages within budget: the PTX nibble masks
    (default) and the plain extraction (the path the CPU tests run) both, BF16 output too."""
    lay = KVCacheLayout.default(8, 128, gran).with_key_bits(4)
    tr = _rotated(8, 128)
    lengths = [33000, 8192, 385, 17]
    torch.manual_seed(0)
    st = _random_cache(lay, lengths, tr)
    assert st.k_codes.shape[-1] == 64 and int(ref.unpack_codes(st.k_codes, 128, 4).max()) == 15
    q_model = torch.randn(len(lengths), 32, 128, device=DEV)
    q = tr.transform_queries(q_model[:, :, None]).squeeze(2).contiguous()
    got = decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 128**-0.5, **variant)
    _budget(got, q, st, lay, tr, 128**-0.5)
    got16 = decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 128**-0.5, out_dtype=torch.bfloat16, **variant)
    _budget(got16.float(), q, st, lay, tr, 128**-0.5)


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_decode_attention_4bit_keys_head_dim_256(gran):
    """Gemma-3-12B's heads (16 / 8, head_dim 256, two groups of 128) with 4-bit key pages within budget."""
    lay = KVCacheLayout.default(8, 256, gran).with_key_bits(4)
    tr = LayerTransform.identity(8, 256, 0.96, 0.92).to(DEV)
    lengths = [16500, 449, 17]
    torch.manual_seed(0)
    st = _random_cache(lay, lengths, tr)
    q = torch.randn(len(lengths), 16, 256, device=DEV)
    _budget(decode_attention(q, st, lay, tr.k_levels, tr.v_levels, 256**-0.5), q, st, lay, tr, 256**-0.5)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("gran", ["token", "channel"])
def test_quantize_and_decode_append_4bit_keys_bit_exact(gran, d):
    """4-bit key pages at a prefill's size (the quantizer) and the decode step's writer across a demotion: every
    buffer equal to the reference's on the GPU."""
    lay = KVCacheLayout.default(8, d, gran, sink=16, window=128).with_key_bits(4)
    tr = LayerTransform.identity(8, d, 0.96, 0.92).to(DEV)
    x = (torch.randn(128, 8, lay.page_size, d, device=DEV) * torch.linspace(0.1, 3, d, device=DEV)).bfloat16().float()
    for name, g, w in zip(("codes", "params"), quantize_pages(x, lay, lay.key, tr.k_clip, tr.k_levels),
                          ref.quantize_pages(x, lay.key, tr.k_clip, tr.k_levels)):
        assert torch.equal(g, w), f"quantize 4-bit {gran} keys {name}: {(g != w).sum().item()} mismatches"
    _assert_four_steps_equal_reference(lay, tr, f"4-bit {gran} d={d}")
