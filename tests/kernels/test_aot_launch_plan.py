"""The launch plan (kernels/aot/launch_plan.py) against the kernels and against what the JIT wrappers launch.

Two independent checks, so that a change to a kernel or a wrapper that is not made in the plan fails here:

* every plan's parameters/constexprs equal the ``@triton.jit`` function's ``arg_names`` (in order);
* each JIT wrapper is called on CPU tensors with the kernel's ``run`` replaced by a recorder: the grid, the
  positional arguments (by identity / value, in order), the constexprs and ``num_warps``/``num_stages`` it
  would launch with must be the plan's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from oscar_export.kernels import decode_step as ds  # noqa: E402
from oscar_export.kernels import quant_pack as qp  # noqa: E402
from oscar_export.kernels.aot import launch_plan as lp  # noqa: E402
from oscar_export.kernels.decode import portable as da  # noqa: E402
from oscar_export.kernels.decode import splits  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout, PagedKV  # noqa: E402
from oscar_export.kernels.transform import LayerTransform  # noqa: E402

LAYOUT = KVCacheLayout.default(3, 64)
HEADS = 9


@pytest.mark.parametrize("name", sorted(lp.PLANS))
def test_plan_matches_the_kernel_signature(name):
    plan = lp.PLANS[name]
    module, attr = plan.kernel.split(":")
    fn = getattr(__import__(module, fromlist=[attr]), attr)
    runtime = [a for a in fn.arg_names if a not in plan.constexprs]
    assert runtime == plan.param_names, f"{name}: kernel runtime args {runtime} != plan {plan.param_names}"
    assert set(fn.arg_names) == set(plan.param_names) | set(plan.constexprs), (fn.arg_names, plan.constexprs)


def test_trt_plans_are_the_originals_reordered():
    for trt, orig in ((lp.TRT_DECODE_SPLIT, lp.DECODE_SPLIT), (lp.TRT_DECODE_MERGE, lp.DECODE_MERGE)):
        assert sorted(trt.params) == sorted(orig.params) and trt.constexprs == orig.constexprs
        assert (trt.num_warps, trt.num_stages, trt.grid, trt.derived) == (orig.num_warps, orig.num_stages, orig.grid,
                                                                           orig.derived)
        inputs, extras, outputs = lp.trt_io(trt)
        assert extras == orig.scalar_params() and inputs and outputs
    with pytest.raises(ValueError, match="not in TensorRT order"):
        lp.trt_io(lp.DECODE_SPLIT)  # outputs before the int32 arguments


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, grid, warmup, **kwargs):
        self.calls.append((grid, args, kwargs))


def _record(monkeypatch, *kernels):
    recs = []
    for k in kernels:
        rec = _Recorder()
        monkeypatch.setattr(k, "run", rec)
        recs.append(rec)
    return recs


def _check_launch(plan, call, constexprs, scalars_given, sizes, known):
    grid, args, kwargs = call
    assert len(args) == len(plan.params), f"{plan.name}: {len(args)} positional args, plan has {len(plan.params)}"
    scalars = plan.scalars(scalars_given, constexprs)
    for (name, typ), a in zip(plan.params, args):
        if typ.startswith("*"):
            assert isinstance(a, torch.Tensor), f"{plan.name}.{name}: expected a tensor, got {type(a).__name__}"
            if name in known:
                assert a is known[name], f"{plan.name}: argument in the position of {name} is not {name}"
        else:
            assert a == scalars[name], f"{plan.name}.{name}: launched {a}, plan says {scalars[name]}"
    launched = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    assert launched == constexprs, f"{plan.name}: constexprs {launched} != plan {constexprs}"
    assert kwargs["num_warps"] == plan.num_warps, f"{plan.name}: num_warps {kwargs['num_warps']} != {plan.num_warps}"
    assert kwargs.get("num_stages", lp.TRITON_DEFAULT_STAGES) == plan.num_stages, plan.name
    want = tuple(plan.grid_for({**sizes, **scalars}, constexprs))
    assert tuple(grid) + (1,) * (3 - len(grid)) == want, f"{plan.name}: grid {grid} != plan {want}"


def _state(batch=2, pool=6, max_pages=4):
    st = PagedKV.allocate(LAYOUT, batch, pool, max_pages, dtype=torch.bfloat16)
    return st, LayerTransform.identity(LAYOUT.num_kv_heads, LAYOUT.head_dim)


def test_jit_decode_attention_launches_the_plan(monkeypatch):
    split, merge = _record(monkeypatch, da.decode_split_kernel, splits.merge_kernel)
    st, t = _state()
    q = torch.randn(2, HEADS, 64)  # the step's fp32 queries in the stored key basis (decode_append's q_rot)
    da.decode_attention(q, st, LAYOUT, t.k_levels, t.v_levels, 0.125, out_dtype=torch.bfloat16, pages_per_split=2)
    cx = lp.decode_split_constexprs(LAYOUT, HEADS, 0.125, fast_unpack=False)  # CPU: no PTX unpack
    known = {f"{n}_ptr": getattr(st, n) for n in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params",
                                                  "v_codes", "v_params", "block_table", "sink_len", "num_pages",
                                                  "recent_len")}
    known.update(q_ptr=q, k_levels_ptr=t.k_levels, v_levels_ptr=t.v_levels)
    _check_launch(lp.DECODE_SPLIT, split.calls[0], cx, {"max_pages": 4, "pages_per_split": 2}, {"B": 2}, known)
    _, sargs, _ = split.calls[0]
    part_o, part_lse = (sargs[lp.DECODE_SPLIT.param_names.index(n)] for n in ("part_o_ptr", "part_lse_ptr"))
    n_splits = lp.DECODE_SPLIT.scalars({"max_pages": 4, "pages_per_split": 2}, cx)["n_splits"]
    assert tuple(part_o.shape) == (2, HEADS, n_splits, 64)
    _check_launch(lp.DECODE_MERGE, merge.calls[0], lp.decode_merge_constexprs(LAYOUT.head_dim), {"n_splits": n_splits},
                  {"rows": 2 * HEADS}, {"part_o_ptr": part_o, "part_lse_ptr": part_lse})


@pytest.mark.parametrize("fused", [False, True])
def test_jit_hopper_decode_launches_the_plan(monkeypatch, fused):
    """The Gluon split kernel's JIT launch (recorded on the CPU: Gluon has no interpreter, nothing runs) is the plan's:
    DECODE_SPLIT_GL or, merge fused, DECODE_SPLIT_MERGE_GL, with the bundle's constexprs and the register cap beside
    them. Failed before: the JIT passed its cp.async stages (3) as num_stages, the plan 2 (no effect on the PTX)."""
    from oscar_export.kernels.decode import hopper, hopper_kernel

    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    split = hopper_kernel.FUSED_KERNEL if fused else hopper_kernel.KERNEL
    rec, merge = _record(monkeypatch, split, splits.merge_kernel)
    lay = KVCacheLayout.default(2, 128, packing="mma16").with_key_bits(4)
    st = PagedKV.allocate(lay, 2, 6, 4)
    t = LayerTransform.identity(2, 128)
    q = torch.randn(2, 8, 128)
    hopper.launch(q, st.sink_k, st.sink_v, st.recent_k, st.recent_v, st.k_codes, st.k_params, st.v_codes, st.v_params,
                  t.k_levels, t.v_levels, st.block_table, st.sink_len, st.num_pages, st.recent_len, 2, lay.page_size,
                  lay.sink, lay.recent_slots, 0.125, False, 2, torch.float32, fused_merge=fused)
    plan = lp.DECODE_SPLIT_MERGE_GL if fused else lp.DECODE_SPLIT_GL
    cx = {**lp.decode_split_gl_constexprs(lay, 8, 0.125), "maxnreg": lp.gl_occupancy(128)[0]}
    known = {f"{n}_ptr": getattr(st, n) for n in ("k_codes", "k_params", "v_codes", "v_params", "block_table")}
    _check_launch(plan, rec.calls[0], cx, {"max_pages": 4, "pages_per_split": 2}, {"B": 2}, {"q_ptr": q, **known})
    assert len(merge.calls) == (0 if fused else 1)


@pytest.mark.parametrize("fused", [False, True])
def test_jit_write_pages_launches_the_plan(monkeypatch, fused):
    (rec,) = _record(monkeypatch, qp._quant_pack_kernel)
    st, t = _state()
    x = torch.randn(3, 3, 64, 64).bfloat16()
    ids = torch.tensor([0, 4, 2], dtype=torch.int32)
    rotation = (t.k_rotation, t.k_scale, t.k_mean) if fused else None
    qp.write_pages(x, ids, st.k_codes, st.k_params, LAYOUT, LAYOUT.key, t.k_clip, t.k_levels, rotation,
                   fused_rotation=fused)
    plan = lp.QUANT_PACK_ROT if fused else lp.QUANT_PACK
    strides = dict(zip(("stride_xn", "stride_xh", "stride_xp"), x.stride()[:3]))
    known = {"page_ids_ptr": ids, "codes_ptr": st.k_codes, "params_ptr": st.k_params}
    if fused:
        known["x_ptr"] = x
    _check_launch(plan, rec.calls[0], lp.quant_pack_constexprs(LAYOUT, LAYOUT.key, fused), strides, {"N": 3}, known)


@pytest.mark.parametrize("fused", [False, True])
def test_jit_decode_step_launches_the_plan(monkeypatch, fused):
    (rec,) = _record(monkeypatch, ds._decode_append_kernel)
    st, t = _state()
    k, v = torch.randn(2, 3, 64).bfloat16(), torch.randn(2, 3, 64).bfloat16()
    status = torch.zeros(2, dtype=torch.int32)
    ds.decode_append(st, k, v, status, LAYOUT, t, fused_transform=fused)
    known = {f"{n}_ptr": getattr(st, n) for n in ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params",
                                                  "v_codes", "v_params", "block_table", "sink_len", "num_pages",
                                                  "recent_len")}
    known.update(k_ptr=k, v_ptr=v, rot_ptr=t.k_rotation, kscale_ptr=t.k_scale, kmean_ptr=t.k_mean,
                 vmean_ptr=t.v_mean, k_levels_ptr=t.k_levels, v_levels_ptr=t.v_levels, status_ptr=status)
    _check_launch(lp.DECODE_APPEND, rec.calls[0], lp.decode_append_constexprs(LAYOUT, fused), {"max_pages": 4},
                  {"B": 2}, known)


def _step_with_queries(monkeypatch, append, heads: int):
    """One recorded decode step of ``append`` (the JIT wrapper or the custom op) rotating ``heads`` queries:
    ``(the launch, q_rot, the tensors it must be given)``."""
    (rec,) = _record(monkeypatch, ds._decode_append_kernel)
    st, t = _state()
    k, v = torch.randn(2, 3, 64).bfloat16(), torch.randn(2, 3, 64).bfloat16()
    q = torch.randn(2, heads, 64).bfloat16()
    status = torch.zeros(2, dtype=torch.int32)
    q_rot = append(st, k, v, status, LAYOUT, t, fused_transform=True, q=q)
    return rec.calls[0], q_rot, {"k_ptr": k, "v_ptr": v, "q_ptr": q, "q_rot_ptr": q_rot, "status_ptr": status}


def test_jit_decode_step_with_the_query_rotation_launches_the_plan(monkeypatch):
    """``decode_append(q=...)``: the same launch rotating the step's queries (``ROTATE_Q``, ``GQ``) as the plan says."""
    call, q_rot, known = _step_with_queries(monkeypatch, ds.decode_append, 12)
    assert q_rot.shape == (2, 12, 64) and q_rot.dtype == torch.float32
    cx = lp.decode_append_constexprs(LAYOUT, True, num_heads=12)
    assert (cx["GQ"], cx["ROTATE_Q"]) == (4, True)
    _check_launch(lp.DECODE_APPEND, call, cx, {"max_pages": 4}, {"B": 2}, known)
    with pytest.raises(ValueError, match="not a multiple"):
        lp.decode_append_constexprs(LAYOUT, True, num_heads=13)


def test_custom_op_decode_step_launches_the_plan(monkeypatch):
    """``oscar::decode_append`` (what a compiled step runs) launches what the plan says, as the wrapper does."""
    from oscar_export.kernels import triton_ops

    call, _, known = _step_with_queries(monkeypatch, triton_ops.decode_append, 24)
    cx = lp.decode_append_constexprs(LAYOUT, True, num_heads=24)
    assert (cx["GQ"], cx["CB"]) == (8, 16)
    _check_launch(lp.DECODE_APPEND, call, cx, {"max_pages": 4}, {"B": 2}, known)


@pytest.mark.parametrize("d,gq,want", [(128, 1, 16), (128, 4, 16), (128, 8, 8), (128, 5, 8), (64, 16, 8),
                                       (256, 4, 8), (128, 64, 1), (16, 1, 16)])
def test_append_columns(d, gq, want):
    """The writer's columns a program: ``APPEND_COLUMNS``, halved until the query product fits ``APPEND_PRODUCT``."""
    cb = lp.append_columns(d, gq)
    assert cb == want and d % cb == 0
    pad = 1 << max(0, (gq - 1).bit_length())
    assert pad * d * cb <= lp.APPEND_PRODUCT or cb == 1


def test_wrapper_constants_are_the_plan():
    assert (da.SPLIT_WARPS, da.SPLIT_STAGES, da.PAGE_SLOTS) == (
        lp.DECODE_SPLIT.num_warps, lp.DECODE_SPLIT.num_stages, lp.PAGE_SLOTS)


def test_query_heads_are_padded_to_each_kernels_mma_n():
    """The portable kernel's dots take N >= 4, the hopper kernel's warpgroup MMAs N >= 8, both powers of two."""
    assert [lp.gq_pad_dot(g) for g in (1, 3, 4, 5, 8, 16)] == [4, 4, 4, 8, 8, 16]
    assert [lp.gq_pad_wgmma(g) for g in (1, 3, 8, 9, 16)] == [8, 8, 8, 16, 16]


@pytest.mark.parametrize("batch,max_pages,want", [
    (1, 62, 4),      # 1x8K: 16 programs a head of GL_MIN_PAGES_PER_SPLIT pages (more, shorter ones measured slower)
    (1, 254, 4),     # 1x32K: one wave of 512 programs
    (1, 1022, 16),   # 1x128K: 64 splits x 8 heads = 512 <= 528 slots (128 splits of 8 pages: 2 waves of 8+2)
    (8, 254, 32),    # 8x32K: 8 splits, one wave
    (32, 254, 127),  # 32x32K: 2 splits, one wave
    (106, 254, 85),  # B * H_kv = 848 > 528: 3 splits (5 waves of 85+2) beat 1 (2 waves of 254+2)
    (1, 3, 3),       # fewer pages than the minimum: one split
])
def test_gl_pages_per_split_fills_whole_waves(batch, max_pages, want):
    """The hopper kernel's split rule on the H200's 132 SMs, 8 KV heads, head_dim 128 (4 CTAs an SM)."""
    pps = lp.gl_pages_per_split(batch, 8, max_pages, 132)
    assert pps == want
    splits = -(-max_pages // pps)
    assert splits * pps >= max_pages and (splits - 1) * pps < max_pages
    assert pps >= min(lp.GL_MIN_PAGES_PER_SPLIT, max_pages)


def test_gl_pages_per_split_head_dim_256_has_half_the_slots_and_bad_sizes_are_refused():
    assert lp.gl_occupancy(128) == (lp.GL_MAXNREG, 4) and lp.gl_occupancy(256) == (0, 2)
    assert lp.gl_pages_per_split(1, 8, 1022, 132, head_dim=256) == 31  # 33 splits x 8 = 264 = 132 x 2
    for bad in ((0, 8, 10, 132), (1, 0, 10, 132), (1, 8, 0, 132), (1, 8, 10, 0)):
        with pytest.raises(ValueError, match="positive sizes"):
            lp.gl_pages_per_split(*bad)


def test_hopper_plan_defaults_the_split_to_the_plan_rule():
    """``triton_ops.plan_decode`` (what the hopper launch reads; checked off the GPU too) takes the launch plan's wave
    rule for mma16 pages and the portable rule for linear ones."""
    pytest.importorskip("triton")
    from oscar_export.kernels import triton_ops
    from oscar_export.kernels.decode import hopper

    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    lay = KVCacheLayout.default(2, 128, packing="mma16")
    tr = LayerTransform.identity(2, 128, 0.96, 0.92)
    q = torch.randn(1, 8, 128)
    got = triton_ops.plan_decode(q, PagedKV.allocate(lay, 1, 64, 62), lay, tr.k_levels, tr.v_levels, 0.1)
    assert got.hopper_kernel and got.pages_per_split == lp.gl_pages_per_split(1, 2, 62, 132) == 4
    lin = lay.with_packing("linear")
    got = triton_ops.plan_decode(q, PagedKV.allocate(lin, 1, 64, 62), lin, tr.k_levels, tr.v_levels, 0.1)
    assert not got.hopper_kernel and got.pages_per_split == da.default_pages_per_split(1, 2, 62, 132)
