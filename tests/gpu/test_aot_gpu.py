"""The AOT bundle on a real GPU: binaries built on the CPU machine, loaded through the driver API.

Run on the H200 (the bundle is built on the CPU machine and carried over)::

    python tests/gpu/test_aot_gpu.py build .aot_bundle          # CPU machine: compile the test bundle
    OSCAR_AOT_BUNDLE=.aot_bundle python -m pytest tests/gpu/test_aot_gpu.py -m gpu -s   # GPU machine

Checks, for the cubin and for the PTX (driver JIT) of every kernel: the parameter list matches the
manifest (``cuFuncGetParamInfo``); results are bitwise equal to the Triton JIT launch of the same kernel
and constexprs (attention outputs: bitwise when the bundle's Triton is the JIT's, else within 2 bf16 ulps on
at most 1 % of them, see ``_attention_matches_jit``); integer kernels equal the reference exactly, attention is
within the error budget of the reference (at most 2x the error of a BF16 PyTorch computation, plus 1e-3); a
decode step captured in a CUDA graph replays correctly with new inputs. A bundle compiled on the GPU machine
with its own Triton (``local``) separates "the AOT path is wrong" from "two Triton versions compile differently".
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

SCALE = 0.125  # 1 / sqrt(64)
HEADS = 9


def layouts():
    from oscar_export.kernels.layout import KVCacheLayout

    return {
        "ktok": KVCacheLayout.default(3, 64),
        "kch": KVCacheLayout.default(3, 64, key_granularity="channel"),
    }


def all_specs(names=("ktok", "kch")):
    from oscar_export.kernels.aot.bundle import serving_specs

    specs = {}
    for i, name in enumerate(names):
        for s in serving_specs(layouts()[name], HEADS, SCALE, probes=(i == 0)):
            specs[s.name] = s
    return list(specs.values())


def build(out: str, archs=("sm_80", "sm_89", "sm_90"), ptx_version="default", names=("ktok", "kch")) -> None:
    """Compile the test bundle; a kernel that does not compile is left out (and said so), not hidden."""
    from oscar_export.kernels.aot.compile import DEFAULT_PTX_VERSION, build_bundle, compile_kernel

    ptx = DEFAULT_PTX_VERSION if ptx_version == "default" else ptx_version
    specs = []
    for s in all_specs(names):
        try:
            compile_kernel(s, "sm_90", ptx)
            specs.append(s)
        except Exception as e:
            while e.__cause__ is not None:
                e = e.__cause__
            print(f"LEFT OUT {s.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    build_bundle(specs, out, archs=archs, ptx_version=ptx,
                 progress=lambda i, n, name: print(f"[{i}/{n}] {name}", flush=True))


# ---- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cuda.bindings")
    import triton

    print(f"\nGPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton (JIT) {triton.__version__}")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def bundles(cuda, tmp_path_factory):
    from oscar_export.kernels.aot.manifest import read_manifest

    out = {}
    path = os.environ.get("OSCAR_AOT_BUNDLE")
    if path:
        m = read_manifest(path)
        print(f"CPU-built bundle: triton {m.data['triton_version']}, ptxas {m.data['ptxas']}, "
              f"{len(m.entries)} binaries")
        out["cpu"] = m
    local = tmp_path_factory.mktemp("local") / "bundle"
    # this machine's Triton and ptxas, native PTX ISA; one layout (the compile time is device time)
    try:
        build(str(local), archs=("sm_90",), ptx_version=None, names=("ktok", "kch"))
        out["local"] = read_manifest(local)
    except Exception as e:  # a diagnostic only: the CPU-built bundle is what is under test
        print(f"local bundle build FAILED (local tests skip): {type(e).__name__}: {str(e)[:300]}")
    return out


SOURCES = [("cpu", "cubin"), ("cpu", "ptx"), ("local", "cubin")]


def _kernel(bundles, where, source, name):
    from oscar_export.kernels.aot.launcher import AotKernel

    if where not in bundles:
        pytest.skip(f"no {where} bundle (set OSCAR_AOT_BUNDLE)")
    if not any(e.name == name for e in bundles[where].entries):
        pytest.skip(f"{name} is not in the {where} bundle (the local bundle holds one layout; see the build log)")
    k = AotKernel(bundles[where], name, source=source)  # checks cuFuncGetParamInfo against the manifest
    got = [s for _, s in k.param_info()]
    assert len(got) == len(k.entry.spec.params) + 2 and got == k.entry.param_bytes()
    return k


def _report(what, a, b):
    eq = torch.equal(a, b)
    if not eq:
        d = (a.float() - b.float()).abs()
        print(f"  {what}: NOT bitwise equal: {int((d > 0).sum())} of {d.numel()} differ, max {d.max().item():.3g}")
    return eq


def _same_triton(bundles, where) -> bool:
    """Whether the bundle was compiled by the Triton the JIT runs (the ``local`` bundle always is)."""
    import triton

    return where == "local" or bundles[where].data["triton_version"] == triton.__version__


def _attention_matches_jit(what, out, jit, same_triton: bool) -> bool:
    """Decode outputs vs the JIT: bitwise when one Triton compiled both. Across Triton versions the order of
    the fp32 reductions inside the kernel (row sums over a page, the page-slot merge) is the compiler's
    choice, so the bf16 outputs may differ in the last bit: then at most 1 % of them may differ, each by at
    most 2 bf16 ulps (seen on the H200, Triton 3.9 bundle vs 3.6 JIT: 1 of 2304, 1 ulp). The accuracy
    against the reference is asserted separately."""
    if _report(what, out, jit) or same_triton:
        return torch.equal(out, jit)
    a, b = out.float(), jit.float()
    d = (a - b).abs()
    ulp = torch.maximum(a.abs(), b.abs()) * 2.0**-7 + 1e-30  # 2 bf16 ulps (8-bit significand)
    return bool((d <= ulp).all()) and int((d > 0).sum()) <= max(1, d.numel() // 100)


# ---- probe kernels --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where,source", SOURCES)
def test_probe_kernels(bundles, where, source, cuda):
    from oscar_export.kernels import reference
    from oscar_export.kernels.aot.probe import _dequant_rows_kernel, _pack_codes_kernel

    rows = 1000
    codes = torch.randint(0, 4, (rows, 64), dtype=torch.uint8, device=cuda)
    pk = _kernel(bundles, where, source, "probe_pack_codes_d64_g64")
    out = torch.empty(rows, 16, dtype=torch.uint8, device=cuda)
    pk.launch(codes, out, rows)
    jit = torch.empty_like(out)
    _pack_codes_kernel[(pk.grid([0, 0, rows])[0],)](codes, jit, rows, D=64, G=64, BLOCK_R=16, num_warps=4, num_stages=1)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference.pack_codes(codes.cpu(), 64))
    assert _report("pack vs JIT", out, jit)

    params = (torch.randn(rows, 1, 2, device=cuda)).half()
    dk = _kernel(bundles, where, source, "probe_dequant_rows_d64_g64")
    deq = torch.empty(rows, 64, dtype=torch.float32, device=cuda)
    dk.launch(out, params, deq, rows)
    jit_deq = torch.empty_like(deq)
    _dequant_rows_kernel[(dk.grid([0, 0, 0, rows])[0],)](out, params, jit_deq, rows, D=64, G=64, BLOCK_R=16,
                                                          num_warps=4, num_stages=1)
    torch.cuda.synchronize()
    ref = reference.dequantize_groups(codes.cpu(), params[:, 0, 0].cpu(), params[:, 0, 1].cpu(),
                                      torch.tensor([0.0, 1.0, 2.0, 3.0]))
    err = (deq.cpu() - ref).abs().max().item()
    print(f"  probe [{where} {source}]: pack exact vs reference; dequant max err vs reference {err:.3g}")
    assert err <= 1e-6 * max(1.0, ref.abs().max().item())  # one FMA rounding at most
    assert _report("dequant vs JIT", deq, jit_deq)


# ---- quantize/pack --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lay", ["ktok", "kch"])
@pytest.mark.parametrize("where,source", SOURCES)
def test_quant_pack(bundles, where, source, lay, cuda):
    from oscar_export.kernels import quant_pack, reference
    from oscar_export.kernels.aot.bundle import layout_tag

    layout = layouts()[lay]
    tag = layout_tag(layout, HEADS)
    n, h, p, d = 5, layout.num_kv_heads, layout.page_size, layout.head_dim
    x = torch.randn(n, h, p, d, device=cuda).bfloat16()
    page_ids = torch.tensor([7, 2, 9, 0, 4], dtype=torch.int32, device=cuda)
    clip = torch.tensor([1.0, 0.96, 0.9], device=cuda)
    levels = torch.tensor([0.0, 1.0, 2.0, 3.0], device=cuda).expand(h, 4).contiguous()
    for which, fmt in (("k", layout.key), ("v", layout.value)):
        k = _kernel(bundles, where, source, f"quant_pack_{which}_{tag}")
        group = p if fmt.granularity == "channel" else fmt.group_size
        removals = quant_pack.removal_counts(clip, group)
        pools = []
        for _ in range(2):
            pools.append((torch.zeros(layout.codes_shape(10), dtype=torch.uint8, device=cuda),
                          torch.zeros(layout.params_shape(fmt, 10), dtype=torch.float16, device=cuda)))
        args = [x, page_ids, removals, levels, levels, levels, levels, pools[0][0], pools[0][1],
                x.stride(0), x.stride(1), x.stride(2)]
        k.launch(*args, grid_inputs={"N": n})
        quant_pack.write_pages(x, page_ids, pools[1][0], pools[1][1], layout, fmt, clip, levels)
        torch.cuda.synchronize()
        rc, rp = reference.quantize_pages(x.float().cpu(), fmt, clip.cpu(), levels.cpu())
        ids = page_ids.long().cpu()
        assert torch.equal(pools[0][0].cpu()[ids], rc) and torch.equal(pools[0][1].cpu()[ids], rp), which
        assert _report(f"quant_pack {which} vs JIT", pools[0][0], pools[1][0])
        assert _report(f"quant_pack {which} params vs JIT", pools[0][1], pools[1][1])
    print(f"  quant_pack [{where} {source} {lay}]: codes and params exact vs reference and JIT")


# ---- decode attention ------------------------------------------------------------------------------------------


def _state(layout, lengths, cuda, seed=0):
    from oscar_export.kernels import reference
    from oscar_export.kernels.layout import PagedKV
    from oscar_export.kernels.transform import LayerTransform

    g = torch.Generator().manual_seed(seed)
    h, d = layout.num_kv_heads, layout.head_dim
    t = LayerTransform.identity(h, d, 0.96, 0.92)
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float().contiguous()
    t = replace(t, k_rotation=rot, k_scale=torch.rand(h, d, generator=g) + 0.5)
    max_pages = max(1, max(layout.pages_for(n) for n in lengths))
    st = PagedKV.allocate(layout, len(lengths), pool_pages=len(lengths) * max_pages + 3, max_pages=max_pages)
    free = list(range(st.k_codes.shape[0]))[::-1]
    for b, n in enumerate(lengths):
        k = torch.randn(h, n, d, generator=g) * 2
        v = torch.randn(h, n, d, generator=g)
        reference.append_tokens(st, b, k, v, layout, t, free.pop)
    st = PagedKV(*[getattr(st, f).to(cuda) for f in st.__dataclass_fields__])
    return st, t, max_pages, free


def _aot_decode(split, merge, q_s, st, t, plan, cuda):
    """The bundle's split + merge over the step's fp32 stored-basis queries ``q_s [B, H, D]``."""
    q = q_s
    part_o = torch.empty(plan.batch, HEADS, plan.n_splits, q.shape[-1], device=cuda)
    part_lse = torch.empty(plan.batch, HEADS, plan.n_splits, device=cuda)
    out = torch.empty(plan.batch, HEADS, q.shape[-1], dtype=torch.bfloat16, device=cuda)
    a = plan.split_args()
    split.launch(q, st.sink_k, st.sink_v, st.recent_k, st.recent_v, st.k_codes, st.k_params, st.v_codes,
                 st.v_params, t.k_levels, t.v_levels, st.block_table, st.sink_len, st.num_pages, st.recent_len,
                 part_o, part_lse, a["max_pages"], a["pages_per_split"], a["n_page_splits"], a["n_splits"],
                 grid_inputs={"B": plan.batch})
    merge.launch(part_o, part_lse, out, plan.n_splits, grid_inputs={"rows": plan.batch * HEADS})
    return out


def _bf16_attention(qs, k, v, valid):
    """The same attention computed by PyTorch in BF16 (the error-budget yardstick)."""
    hkv = k.shape[1]
    b, h, d = qs.shape
    qg = qs.bfloat16().view(b, hkv, h // hkv, d)
    s = torch.matmul(qg, k.bfloat16().transpose(-1, -2)) * SCALE
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s.float(), -1).bfloat16()
    return torch.matmul(p, v.bfloat16()).view(b, h, d).float()


def _check_reference_budget(out, q, t, st, layout, what):
    """The bundle's output against the reference: at most 2x the error of a BF16 PyTorch computation + 1e-3."""
    from oscar_export.kernels import reference

    qs = t.transform_queries(q.float().cpu()[:, :, None]).squeeze(2)
    cpu_st = type(st)(*[getattr(st, f).cpu() for f in st.__dataclass_fields__])
    ref = reference.decode_attention(qs, cpu_st, layout, t.k_levels, t.v_levels, SCALE)
    k, v, valid = reference.gather_context(cpu_st, layout, t.k_levels, t.v_levels)
    lp = _bf16_attention(qs.to(out.device), k.to(out.device), v.to(out.device), valid.to(out.device)).cpu()
    err, lp_err = (out.float().cpu() - ref).abs().max().item(), (lp - ref).abs().max().item()
    print(f"  {what}: max err vs reference {err:.3g}, BF16 torch {lp_err:.3g}")
    assert err <= 2 * lp_err + 1e-3


def _check_graph_replay(split, merge, q, out, tc, st, plan, cuda, what):
    """Capture one decode (split + merge) in a CUDA graph, change the query in place, replay: equal to an eager
    launch with the new query (and not the old output)."""
    static_q = q.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _aot_decode(split, merge, static_q, st, tc, plan, cuda)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = _aot_decode(split, merge, static_q, st, tc, plan, cuda)
    q2 = torch.randn_like(q)
    static_q.copy_(q2)
    graph.replay()
    eager = _aot_decode(split, merge, q2, st, tc, plan, cuda)
    torch.cuda.synchronize()
    assert not torch.equal(g_out, out)  # the replay really used the new query
    assert torch.equal(g_out, eager), "graph replay differs from an eager launch"
    print(f"  {what}: CUDA graph replay == eager launch")


def _decode_inputs(layout, cuda):
    """A decode step's inputs over ragged lengths (no pages, first page edge, several pages): ``(lengths, state,
    transform, transform on the GPU, max_pages, q, q_s)``, ``q_s`` the step's stored-basis queries (what
    ``decode_append`` writes)."""
    from oscar_export.kernels.decode_step import rotate_queries

    lengths = [1, 321, 777, 1500]
    st, t, max_pages, _ = _state(layout, lengths, cuda)
    tc = t.to(cuda)
    q = torch.randn(len(lengths), HEADS, layout.head_dim, device=cuda).bfloat16()
    return lengths, st, t, tc, max_pages, q, rotate_queries(q, tc).contiguous()


@pytest.mark.parametrize("lay", ["ktok", "kch"])
@pytest.mark.parametrize("where,source", SOURCES)
def test_decode_attention(bundles, where, source, lay, cuda):
    from oscar_export.kernels.aot.bundle import decode_plan, layout_tag
    from oscar_export.kernels.decode import portable as jit_mod

    layout = layouts()[lay]
    tag = layout_tag(layout, HEADS)
    lengths, st, t, tc, max_pages, q, q_s = _decode_inputs(layout, cuda)
    split = _kernel(bundles, where, source, f"decode_split_{tag}")
    merge = _kernel(bundles, where, source, f"decode_merge_{tag}")
    pps = 2
    plan = decode_plan(layout, len(lengths), HEADS, max_pages, pps)
    out = _aot_decode(split, merge, q_s, st, tc, plan, cuda)
    jit = jit_mod.decode_attention(q_s, st, layout, tc.k_levels, tc.v_levels, SCALE, out_dtype=torch.bfloat16,
                                   pages_per_split=pps)
    torch.cuda.synchronize()
    _check_reference_budget(out, q, t, st, layout,
                            f"decode [{where} {source} {lay}] B={len(lengths)} lengths {lengths}")
    assert _attention_matches_jit("decode vs JIT", out, jit, _same_triton(bundles, where))

    # The TensorRT-order variants (what plugins/trt hands TensorRT) through the same driver path.
    tsplit = _kernel(bundles, where, source, f"trt_decode_split_{tag}")
    tmerge = _kernel(bundles, where, source, f"trt_decode_merge_{tag}")
    part_o = torch.empty(plan.batch, HEADS, plan.n_splits, layout.head_dim, device=cuda)
    part_lse = torch.empty(plan.batch, HEADS, plan.n_splits, device=cuda)
    tout = torch.empty_like(out)
    a = plan.split_args()
    tsplit.launch(q_s, st.sink_k, st.sink_v, st.recent_k, st.recent_v, st.k_codes, st.k_params, st.v_codes,
                  st.v_params, tc.k_levels, tc.v_levels, st.block_table, st.sink_len, st.num_pages, st.recent_len,
                  a["max_pages"], a["pages_per_split"], a["n_page_splits"], a["n_splits"], part_o, part_lse,
                  grid_inputs={"B": plan.batch})
    tmerge.launch(part_o, part_lse, plan.n_splits, tout, grid_inputs={"rows": plan.batch * HEADS})
    torch.cuda.synchronize()
    assert _report("TensorRT-order kernels vs decode", tout, out)

    # CUDA graph: capture one step, change the query in place, replay, compare with an eager launch.
    _check_graph_replay(split, merge, q_s, out, tc, st, plan, cuda, f"decode [{where} {source} {lay}]")


# ---- the TensorRT-LLM module's device ops (plugins/trtllm/device.py), without TensorRT-LLM ----------------


@pytest.mark.parametrize("pps", [1, 2])
@pytest.mark.parametrize("lay", ["ktok", "kch"])
@pytest.mark.parametrize("where,source", [("cpu", "cubin"), ("cpu", "ptx")])
def test_trtllm_device_ops(bundles, where, source, lay, pps, cuda):
    from oscar_export.kernels import reference
    from oscar_export.kernels.aot.bundle import layout_tag
    from oscar_export.kernels.decode import portable as jit_mod
    from oscar_export.kernels.decode_step import rotate_queries
    from oscar_export.plugins.trtllm.device import AotCacheOps

    layout = layouts()[lay]
    tag = layout_tag(layout, HEADS)
    for name in (f"quant_pack_k_{tag}", f"decode_split_{tag}"):
        _kernel(bundles, where, source, name)  # skips cleanly if the kernel is not in the bundle
    ops = AotCacheOps(bundles[where], layout, HEADS, source=source)
    lengths = [384, 500, 1000]  # recent exactly full (demotes now, no pages yet), one page, several
    st, t, _, free = _state(layout, lengths, cuda, seed=3)
    tc = t.to(cuda)
    st.block_table[0, 0] = free[-1]  # the page row 0's demotion fills (a free pool page)
    cpu = type(st)(*[getattr(st, f).cpu().clone() for f in st.__dataclass_fields__])
    k = torch.randn(len(lengths), layout.num_kv_heads, layout.head_dim, device=cuda).bfloat16()
    v = torch.randn_like(k)
    status = torch.tensor([0, 0, 2], dtype=torch.int32, device=cuda)  # row 2 flagged (STATUS_FULL): no write
    cpu_status = status.cpu()
    reference.decode_append(cpu, k.cpu(), v.cpu(), cpu_status, layout, t)
    q = torch.randn(len(lengths), HEADS, layout.head_dim, device=cuda).bfloat16()
    q_s = ops.decode_step(st, k, v, status, tc, q)
    torch.cuda.synchronize()
    torch.testing.assert_close(q_s, rotate_queries(q, tc), rtol=1e-5, atol=1e-4)  # fp32 FMA order
    diff = [f for f in st.__dataclass_fields__ if not torch.equal(getattr(st, f).cpu(), getattr(cpu, f))]
    assert not diff, f"AOT decode step differs from reference.decode_append in {diff}"
    assert torch.equal(status.cpu(), cpu_status)
    assert not torch.equal(st.k_codes[free[-1]].cpu(), torch.zeros_like(cpu.k_codes[0]))  # the demotion happened
    for i, n in enumerate(lengths[:2]):  # the step's lengths (what the attention of the step reads)
        st.sink_len[i], st.num_pages[i], st.recent_len[i] = layout.split(n + 1)
    out = ops.decode(q_s, st, tc, pages_per_split=pps)
    jit = jit_mod.decode_attention(q_s, st, layout, tc.k_levels, tc.v_levels, SCALE, out_dtype=torch.bfloat16,
                                   pages_per_split=pps)
    torch.cuda.synchronize()
    assert _attention_matches_jit("device-ops decode vs JIT", out, jit, _same_triton(bundles, where))
    print(f"  trtllm device ops [{where} {source} {lay} pps={pps}]: decode step == reference.decode_append, "
          "step queries == rotate_queries, decode == JIT")


@pytest.mark.parametrize("lay", ["ktok", "kch"])
def test_trtllm_serving_sequence(bundles, lay, cuda):
    """Prefill three prompts, then decode 140 steps the way the TensorRT-LLM module does (the page book's step
    around the AOT device ops: write at the committed length, one decode_append per step, commit); after
    every step the cache equals reference.append_tokens'."""
    from oscar_export.kernels import reference
    from oscar_export.kernels.aot.bundle import layout_tag
    from oscar_export.kernels.decode import portable as jit_mod
    from oscar_export.kernels.layout import PagedKV
    from oscar_export.kernels.pages import PageBook
    from oscar_export.plugins.trtllm.device import AotCacheOps

    layout = layouts()[lay]
    _kernel(bundles, "cpu", "cubin", f"quant_pack_k_{layout_tag(layout, HEADS)}")
    _kernel(bundles, "cpu", "cubin", f"decode_append_{layout_tag(layout, HEADS)}")
    ops = AotCacheOps(bundles["cpu"], layout, HEADS)
    _, t, _, _ = _state(layout, [1], torch.device("cpu"), seed=5)
    tc = t.to(cuda)
    prompts, steps = {0: 380, 1: 600, 2: 60}, 140
    book = PageBook(layout, 3, max(prompts.values()) + steps, cuda)
    st = PagedKV.allocate(layout, 3, book.num_pool_pages, book.max_pages, device=cuda)
    committed, in_step = book.state_view(st, book.committed), book.state_view(st, book.in_step)
    ref = PagedKV.allocate(layout, 3, book.num_pool_pages, book.max_pages)
    ref.block_table.copy_(book.block_table.cpu())  # the reference writes the book's pages
    g = torch.Generator().manual_seed(7)
    rows = {b: ((torch.randn(3, n + steps, 64, generator=g) * 2).bfloat16(),
                torch.randn(3, n + steps, 64, generator=g).bfloat16())
            for b, n in prompts.items()}

    def check(what):
        torch.cuda.synchronize()
        diff = [f for f in ref.__dataclass_fields__ if not torch.equal(getattr(committed, f).cpu(), getattr(ref, f))]
        assert not diff, f"{what}: AOT cache differs from the reference in {diff}"

    grow = torch.tensor(list(prompts.values()), dtype=torch.int32, device=cuda)
    book.begin(grow)
    for b, n in prompts.items():
        k, v = rows[b]
        ops.write(committed, b, 0, k[:, :n].to(cuda), v[:, :n].to(cuda), tc)
        reference.append_tokens(ref, b, k[:, :n].float(), v[:, :n].float(), layout, t)
    book.commit(grow)
    check("prefill")
    for step in range(steps):
        pos = [int(n) for n in book.seq_len.tolist()]
        k = torch.stack([rows[b][0][:, pos[b]] for b in prompts]).to(cuda)  # [3, H_kv, D]
        v = torch.stack([rows[b][1][:, pos[b]] for b in prompts]).to(cuda)
        book.begin(1)
        q = torch.randn(3, HEADS, 64, device=cuda).bfloat16()
        q_s = ops.decode_step(committed, k, v, book.status, tc, q)
        if step % 35 == 34:
            out = ops.decode(q_s, in_step, tc, pages_per_split=2)
            jit = jit_mod.decode_attention(q_s, in_step, layout, tc.k_levels, tc.v_levels, SCALE,
                                           out_dtype=torch.bfloat16, pages_per_split=2)
            torch.cuda.synchronize()
            assert _attention_matches_jit(f"step {step} decode vs JIT", out, jit, _same_triton(bundles, "cpu"))
        book.commit(1)
        for b in prompts:
            reference.append_tokens(ref, b, rows[b][0][:, pos[b] : pos[b] + 1].float(),
                                    rows[b][1][:, pos[b] : pos[b] + 1].float(), layout, t)
        check(f"step {step}")
    assert int(book.status.abs().sum()) == 0 and int(book.committed.num_pages[0]) >= 3
    print(f"  trtllm serving sequence [{lay}]: {steps} steps x 3 sequences, cache == reference after every step, "
          "decode matches the JIT")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "build":
        build(sys.argv[2])
        print(f"wrote {Path(sys.argv[2]).resolve()}")
    else:
        sys.exit(f"usage: {sys.argv[0]} build OUT_DIR")


# ---- the Hopper (Gluon) split kernel, through the driver API -------------------------------------------------------


@pytest.mark.parametrize("source", ["cubin", "ptx"])
def test_gluon_decode_bundle_equals_jit(cuda, tmp_path, source):
    """An sm_90 bundle of the Gluon split kernel (``serving_specs`` of mma16 pages), compiled here by
    this machine's Triton, launched through the driver API: bitwise equal to the JIT launch of the same kernel,
    within budget of the reference, and a CUDA-graph replay equal to an eager launch. (A bundle built on the CPU
    machine by another Triton is not tested here: the harness's CPU bundle is built for sm_80/89 too, which a
    Gluon kernel of warpgroup MMAs refuses.)"""
    from oscar_export.kernels.aot.bundle import decode_merge_spec, decode_plan, decode_split_spec, layout_tag
    from oscar_export.kernels.aot.compile import build_bundle
    from oscar_export.kernels.aot.launcher import AotKernel
    from oscar_export.kernels.aot.manifest import read_manifest
    from oscar_export.kernels.decode import hopper
    from oscar_export.kernels.layout import KVCacheLayout

    layout = KVCacheLayout.default(3, 64, packing="mma16")
    tag = layout_tag(layout, HEADS)
    specs = [decode_split_spec(layout, HEADS, SCALE, tag), decode_merge_spec(layout, tag)]
    m = read_manifest(build_bundle(specs, tmp_path / "gl", archs=["sm_90"], ptx_version=None))
    split, merge = (AotKernel(m, s.name, source=source) for s in specs)
    lengths, st, t, tc, max_pages, q, q_s = _decode_inputs(layout, cuda)
    pps = 2
    plan = decode_plan(layout, len(lengths), HEADS, max_pages, pps)
    out = _aot_decode(split, merge, q_s, st, tc, plan, cuda)
    jit = hopper.decode_attention(q_s, st, layout, tc.k_levels, tc.v_levels, SCALE, out_dtype=torch.bfloat16,
                                  pages_per_split=pps)
    torch.cuda.synchronize()
    assert _report("gluon bundle vs JIT", out, jit)
    _check_reference_budget(out, q, t, st, layout, f"gluon decode [{source}]")
    _check_graph_replay(split, merge, q_s, out, tc, st, plan, cuda, f"gluon decode [{source}]")
