"""The TensorRT-LLM adapter's device ops through the AOT bundle on a GPU, without TensorRT-LLM.

Run on the H200 (the bundle is compiled there, for this GPU only, with the machine's own Triton)::

    python -m pytest tests/gpu/test_trtllm_gpu.py -m gpu -s

Checks: ``AotCacheOps.decode_step`` (the bundle's ``demote_due`` + ``append`` through the driver API) leaves
the same cache bytes as the JIT ``decode_step.decode_step_update``, on rows that demote and rows that do not;
``AotCacheOps.decode`` equals the JIT ``decode_attention`` bit for bit (same Triton, same launch plan); and the
adapter's whole decode step (``OscarAttention._decode``: mask the inactive rows, decode step, restore, decode
attention), captured once in a CUDA graph, replays over 40 steps with new tokens exactly as eager runs it.
"""

from __future__ import annotations

from dataclasses import fields, replace
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu
HEADS, SCALE, PPS = 8, 0.125, 2


def _layout():
    from oscar_export.kernels.layout import KVCacheLayout

    return KVCacheLayout.default(2, 64, sink=16, window=48, page_size=16)  # S0 16, W+P 64, P 16


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cuda.bindings")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def ops(cuda, tmp_path_factory):
    from oscar_export.kernels.aot.bundle import decode_merge_spec, decode_split_spec, decode_step_specs, layout_tag
    from oscar_export.kernels.aot.bundle import quant_pack_spec
    from oscar_export.kernels.aot.compile import build_bundle
    from oscar_export.kernels.aot.manifest import read_manifest
    from oscar_export.plugins.trtllm.device import AotCacheOps

    lay = _layout()
    tag = layout_tag(lay, HEADS)
    specs = [decode_split_spec(lay, HEADS, SCALE, tag), decode_merge_spec(lay, tag), *decode_step_specs(lay, tag),
             quant_pack_spec(lay, lay.key, "k", False, tag), quant_pack_spec(lay, lay.value, "v", False, tag)]
    major, minor = torch.cuda.get_device_capability()
    out = build_bundle(specs, tmp_path_factory.mktemp("b") / "bundle", archs=[f"sm_{10 * major + minor}"],
                       ptx_version=None)
    return AotCacheOps(read_manifest(out), lay, HEADS)


def _transform(cuda):
    from oscar_export.kernels.transform import LayerTransform

    lay = _layout()
    t = LayerTransform.identity(lay.num_kv_heads, lay.head_dim, k_clip=0.97, v_clip=0.95)
    rot = torch.linalg.qr(torch.randn(lay.num_kv_heads, 64, 64))[0]
    return replace(t, k_rotation=rot, k_scale=torch.rand(lay.num_kv_heads, 64) + 0.5).to(cuda)


def _state(cuda, lengths, seed=0):
    """A cache whose rows hold ``lengths`` tokens (random contents, pages in a shuffled pool)."""
    from oscar_export.kernels.layout import PagedKV

    lay = _layout()
    torch.manual_seed(seed)
    b, pool, m = len(lengths), 64, 8
    st = PagedKV.allocate(lay, b, pool, m, cuda, torch.bfloat16)
    for f in ("sink_k", "sink_v", "recent_k", "recent_v"):
        getattr(st, f).copy_(torch.randn_like(getattr(st, f)))
    st.k_codes.copy_(torch.randint(0, 256, st.k_codes.shape, dtype=torch.uint8))
    st.v_codes.copy_(torch.randint(0, 256, st.v_codes.shape, dtype=torch.uint8))
    st.k_params.copy_((torch.rand_like(st.k_params.float()) * 0.1).half())
    st.v_params.copy_((torch.rand_like(st.v_params.float()) * 0.1).half())
    st.block_table.copy_(torch.randperm(pool)[: b * m].view(b, m).to(torch.int32))
    for i, n in enumerate(lengths):
        st.sink_len[i], st.num_pages[i], st.recent_len[i] = lay.split(n)
    return st


def _clone(st):
    return type(st)(**{f.name: getattr(st, f.name).clone() for f in fields(st)})


def _assert_same(a, b, what):
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert torch.equal(x, y), f"{what}: {f.name} differs ({(x != y).sum().item()} elements)"


#: rows: empty, filling the sink, recent full (demotes now), recent full with pages, one after a demotion
LENGTHS = [0, 7, 16 + 64, 16 + 3 * 16 + 64, 16 + 64 + 1]


def test_decode_step_aot_equals_jit(ops, cuda):
    from oscar_export.kernels.decode_step import decode_step_update

    t = _transform(cuda)
    aot, jit = _state(cuda, LENGTHS), _state(cuda, LENGTHS)
    k = torch.randn(len(LENGTHS), 2, 64, device=cuda).bfloat16()
    v = torch.randn_like(k)
    ops.decode_step(aot, k, v, t)
    decode_step_update(jit, k, v, _layout(), t)
    torch.cuda.synchronize()
    _assert_same(aot, jit, "decode_step AOT vs JIT")
    assert aot.num_pages.tolist() != _state(cuda, LENGTHS).num_pages.tolist()  # a demotion really happened


def test_decode_aot_equals_jit(ops, cuda):
    from oscar_export.kernels.decode_attention import decode_attention

    t = _transform(cuda)
    st = _state(cuda, [1, 17, 80, 16 + 5 * 16 + 40])
    q = torch.randn(4, HEADS, 64, device=cuda).bfloat16()
    got = ops.decode(q, st, t, PPS)
    want = decode_attention(q, st, _layout(), t.k_levels, t.v_levels, SCALE, q_rotation=(t.k_rotation, t.k_scale),
                            out_dtype=torch.bfloat16, pages_per_split=PPS)
    assert torch.equal(got, want), f"AOT vs JIT decode: max |diff| {(got.float() - want.float()).abs().max().item()}"


def test_adapter_decode_step_cuda_graph_replay_equals_eager(ops, cuda):
    from oscar_export.plugins.trtllm.attention import make_attention_class
    from oscar_export.plugins.trtllm.book import PageBook

    lay, t = _layout(), _transform(cuda)

    class Backend:
        def __init__(self, layer_idx, num_heads, head_dim, num_kv_heads=None, quant_config=None, **kw):
            self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
            self.num_kv_heads = num_kv_heads

    dep = SimpleNamespace(sm_scale=SCALE, layout=lay, num_layers=1, transform=lambda i, dev: t)
    attn = make_attention_class(SimpleNamespace(AttentionBackend=Backend), dep)(0, HEADS, 64, 2)
    lengths = [30, 79, 0, 16 + 2 * 16 + 63]  # row 2 idle, row 4 = the scratch row
    book = PageBook(lay, 4, 8)

    def mgr_for(state):
        m = SimpleNamespace(book=book, step_slots=torch.tensor([3, 0, 1, 4, 4], dtype=torch.int32, device=cuda))
        return m, state

    eager_st, graph_st = _state(cuda, lengths + [0]), _state(cuda, lengths + [0])
    g_rows = 4  # three requests + one padding row (-> scratch)
    static = {n: torch.zeros(g_rows, w, device=cuda, dtype=torch.bfloat16) for n, w in (("q", HEADS * 64),
                                                                                        ("k", 128), ("v", 128))}
    gm, _ = mgr_for(graph_st)
    run = lambda m, st, q, k, v: attn._decode(m, st, ops, t, q, k, v, 0, g_rows, 0, g_rows)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warmup outside the graph, on a scratch copy
        run(gm, _clone(graph_st), static["q"], static["k"], static["v"])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(gm, graph_st, static["q"], static["k"], static["v"])
    em, _ = mgr_for(eager_st)
    for step in range(40):
        x = {n: torch.randn_like(b) for n, b in static.items()}
        for n in static:
            static[n].copy_(x[n])
        graph.replay()
        want = run(em, eager_st, x["q"], x["k"], x["v"])
        torch.cuda.synchronize()
        assert torch.equal(static_out[:3], want[:3]), f"step {step}: graph replay output differs from eager"
        _assert_same(graph_st, eager_st, f"step {step}: graph replay cache vs eager")
    assert int(eager_st.recent_len[2]) == 0 and int(eager_st.sink_len[4]) == 0  # idle and scratch rows untouched
