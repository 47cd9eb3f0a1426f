"""The serving kernels' bundle on the CPU: specs match the Triton kernels, every variant compiles for every
target and passes the gates, and the host launch plan equals the JIT wrapper's arithmetic."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from oscar_export.kernels.aot import bundle  # noqa: E402
from oscar_export.kernels.aot import launch_plan as lp  # noqa: E402
from oscar_export.kernels.aot.compile import DEFAULT_ARCHS, compile_kernel  # noqa: E402
from oscar_export.kernels.aot.manifest import SHARED_LIMIT  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout  # noqa: E402

LAYOUTS = {
    "smollm2": (KVCacheLayout.default(3, 64), 9),
    "channel_keys": (KVCacheLayout.default(3, 64, key_granularity="channel"), 9),
    "d128_gqa4": (KVCacheLayout.default(2, 128), 8),
    "gemma3_12b": (KVCacheLayout.default(8, 256), 16),  # head_dim 256: two groups of 128 per row, P = 128
    "mma16_llama": (KVCacheLayout.default(8, 128, packing="mma16", page_size=64), 32),
    "mma16_channel": (KVCacheLayout.default(3, 64, key_granularity="channel", packing="mma16"), 9),
    "k4_llama": (KVCacheLayout.default(8, 128).with_key_bits(4), 32),  # 4-bit keys
    "k4_channel_d256": (KVCacheLayout.default(8, 256, "channel").with_key_bits(4), 16),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_specs_match_kernels(name):
    layout, heads = LAYOUTS[name]
    specs = bundle.serving_specs(layout, heads, layout.head_dim ** -0.5)
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        s.jit_function()  # raises if params/constexprs do not match the kernel's arguments, in order


@pytest.mark.parametrize("batch, max_pages, pps", [(1, 1, 1), (4, 23, 2), (64, 128, 8)])
def test_decode_plan(batch, max_pages, pps):
    layout, heads = LAYOUTS["smollm2"]
    plan = bundle.decode_plan(layout, batch, heads, max_pages, pps)
    assert plan.n_page_splits == -(-max_pages // pps)
    assert plan.n_splits == plan.n_page_splits + 1 + 6  # sink 64 = 1 chunk, the recent ring 384 = 6 chunks of 64
    with pytest.raises(ValueError, match="must be > 0"):
        bundle.decode_plan(layout, batch, heads, max_pages, 0)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_append_launch_rotates_the_queries_once_a_step(name):
    """The bundle's decode_append rotates the step's H queries into the stored key basis
    (``ROTATE_Q``, ``GQ = H / H_kv``, an fp32 ``q_rot``), and every split kernel (JIT order and TensorRT order) reads
    those fp32 queries, rotating nothing in its programs."""
    layout, heads = LAYOUTS[name]
    tag = bundle.layout_tag(layout, heads)
    specs = {s.name: s for s in bundle.serving_specs(layout, heads, 0.125, probes=False)}
    append = specs[f"decode_append_{tag}"]
    gq = heads // layout.num_kv_heads
    assert (append.constexpr_dict["ROTATE_Q"], append.constexpr_dict["GQ"]) == (True, gq)
    assert append.constexpr_dict["CB"] == lp.append_columns(layout.head_dim, gq)
    assert {p.name: p.type for p in append.params}["q_rot_ptr"] == "*fp32"
    splits = [specs[f"decode_split_{tag}"]] + ([specs[f"trt_decode_split_{tag}"]] if layout.packing == "linear" else [])
    for s in splits:
        assert {p.name: p.type for p in s.params}["q_ptr"] == "*fp32", s.name
        assert not {"rot_ptr", "dscale_ptr"} & {p.name for p in s.params}, f"{s.name}: takes the key rotation"
        assert not s.constexpr_dict.get("ROTATE_Q", False), f"{s.name}: rotates the queries in every split program"


def test_bad_heads():
    with pytest.raises(ValueError, match="not a multiple"):
        bundle.decode_split_spec(KVCacheLayout.default(3, 64), 8, 0.125, "t")


@pytest.mark.slow  # ~1 min on 2 CPUs: the real bundle, every variant x 3 targets, each through ptxas
@pytest.mark.representative
def test_serving_bundle_compiles_for_every_target():
    layout, heads = LAYOUTS["smollm2"]
    failures = []
    for spec in bundle.serving_specs(layout, heads, 0.125, probes=False):
        for arch in DEFAULT_ARCHS:
            try:
                ck = compile_kernel(spec, arch)
            except Exception as e:  # collect all, report together with the root cause
                while e.__cause__ is not None:
                    e = e.__cause__
                failures.append(f"{spec.name} {arch}: {type(e).__name__}: {str(e)[:160]}")
                continue
            assert ck.entry.shared <= SHARED_LIMIT[ck.entry.arch]
    assert not failures, "\n".join(failures)


def test_decode_kernels_compile_for_sm90():
    layout, heads = LAYOUTS["smollm2"]
    tag = bundle.layout_tag(layout, heads)
    for spec in (bundle.decode_split_spec(layout, heads, 0.125, tag), bundle.decode_merge_spec(layout, tag)):
        ck = compile_kernel(spec, "sm_90")  # gates: scratch 0, params + 2, shared memory
        assert ck.entry.symbol in ck.ptx.decode()


def test_decode_step_kernels_compile_for_sm90():
    """The decode step's decode_append (one launch: token + demotion into the ring) passes the AOT gates: scratch 0,
    params + 2."""
    layout, heads = LAYOUTS["smollm2"]
    for spec in bundle.decode_step_specs(layout, heads, bundle.layout_tag(layout, heads)):
        ck = compile_kernel(spec, "sm_90")
        assert ck.entry.symbol in ck.ptx.decode() and ck.entry.shared <= SHARED_LIMIT[90]


def test_head_dim_256_kernels_compile_for_sm90():
    """Gemma 3's layout (D 256, G 128): the grouped decode split and the fused-rotation
    quantizer (R read in row blocks: the whole fp32 [256, 256] would need 384 KB of shared memory) pass the AOT
    gates."""
    layout, heads = LAYOUTS["gemma3_12b"]
    tag = bundle.layout_tag(layout, heads)
    assert tag == "h16kv8d256g128p128s64w256_ktok"
    for spec in (bundle.decode_split_spec(layout, heads, 256 ** -0.5, tag),
                 bundle.quant_pack_spec(layout, layout.key, "k", True, tag)):
        ck = compile_kernel(spec, "sm_90")
        assert ck.entry.symbol in ck.ptx.decode() and ck.entry.shared <= SHARED_LIMIT[90]


@pytest.mark.slow  # ~30 s: one more decode split through ptxas
def test_head_dim_256_channel_keys_compile_for_sm90():
    """Channel keys with two packing groups per row (D 256, G 128): the grouped split's channel-key scores."""
    layout = KVCacheLayout.default(8, 256, "channel")
    ck = compile_kernel(bundle.decode_split_spec(layout, 16, 256 ** -0.5, bundle.layout_tag(layout, 16)), "sm_90")
    assert ck.entry.shared <= SHARED_LIMIT[90]


def test_4bit_key_variants_are_named_and_set():
    """``key_bits=(2, 4)``: one set of variants per key width, the 4-bit one tagged ``_k4`` with the key constexprs
    at 4 and the value writer at 2; an mma16 layout cannot have 4-bit keys (refused, not silently built)."""
    layout, heads = LAYOUTS["d128_gqa4"]
    specs = bundle.serving_specs(layout, heads, 0.125, probes=False, key_bits=(2, 4))
    names = {s.name: s for s in specs}
    assert len(names) == len(specs) == 2 * len(bundle.serving_specs(layout, heads, 0.125, probes=False))
    tag4 = bundle.layout_tag(layout.with_key_bits(4), heads)
    assert tag4 == "h8kv2d128p128s64w256_ktok_k4" and bundle.layout_tag(layout, heads) == "h8kv2d128p128s64w256_ktok"
    cx = lambda name: names[f"{name}_{tag4}"].constexpr_dict  # noqa: E731
    assert cx("decode_split")["KEY_BITS"] == cx("trt_decode_split")["KEY_BITS"] == cx("decode_append")["K_BITS"] == 4
    assert cx("quant_pack_k")["BITS"] == cx("quant_pack_k_rot")["BITS"] == 4 and cx("quant_pack_v")["BITS"] == 2
    assert names[f"decode_split_{bundle.layout_tag(layout, heads)}"].constexpr_dict["KEY_BITS"] == 2
    gl = bundle.serving_specs(LAYOUTS["mma16_llama"][0], 32, 0.125, probes=False, key_bits=(2, 4))
    # mma16 pages: the Hopper kernel, which reads 4-bit mma16 key pages
    assert sorted(s.constexpr_dict["KEY_BITS"] for s in gl if s.name.startswith("decode_split_")) == [2, 4]


@pytest.mark.parametrize("name", ["k4_llama", pytest.param("k4_channel_d256", marks=pytest.mark.slow)])  # d256: ~30 s
def test_4bit_key_bundle_compiles_and_records_key_bits(name, tmp_path):
    """The 4-bit-key decode split (Llama-3-8B's shape; channel keys at head_dim 256, two groups per row) and
    key writer pass the AOT gates for sm_90; the manifest records the key widths."""
    from oscar_export.kernels.aot.compile import build_bundle
    from oscar_export.kernels.aot.manifest import read_manifest

    layout, heads = LAYOUTS[name]
    tag = bundle.layout_tag(layout, heads)
    specs = [bundle.decode_split_spec(layout, heads, layout.head_dim ** -0.5, tag),
             bundle.quant_pack_spec(layout, layout.key, "k", False, tag)]
    out = build_bundle(specs, tmp_path / "b", archs=["sm_90"], key_bits=[4, 2])
    m = read_manifest(out)
    assert m.key_bits == [2, 4]
    for s in specs:
        e = m.entry(s.name, "sm_90")
        cx = e.spec.constexpr_dict
        assert e.shared <= SHARED_LIMIT[90] and cx.get("KEY_BITS", cx.get("BITS")) == 4


def test_4bit_key_decode_append_compiles_for_sm90():
    """The 4-bit-key decode-step writer (K_BITS 4) passes the AOT gates for sm_90 (~4 s), its demotion compiled as
    functions of their own (keys and values), called, not inlined: inlined, Triton 3.6's coalescing pass (the H200's
    Triton) spends most of the compile on the one large function (the append kernel's cold JIT: 10.5 s of CPU
    instead of 2.8; Triton 3.9 does not show it)."""
    layout, heads = LAYOUTS["k4_llama"]
    for spec in bundle.decode_step_specs(layout, heads, bundle.layout_tag(layout, heads)):
        ck = compile_kernel(spec, "sm_90")
        ptx = ck.ptx.decode()
        assert ck.entry.symbol in ptx and ck.entry.shared <= SHARED_LIMIT[90]
        demotes = set(re.findall(r"^\.func\s+(\S*_demote\S*?)\(", ptx, re.M))
        assert len(demotes) == 2, f"expected the key and the value demotion as two .func, got {sorted(demotes)}"
        assert len(re.findall(r"^\s*call(\.uni)?\s", ptx, re.M)) == 2, "expected two call sites of the demotion"


@pytest.mark.parametrize("name", ["mma16_llama", "mma16_channel"])
def test_mma16_bundle_carries_the_hopper_kernel_and_records_the_packing(name, tmp_path):
    """An mma16 layout's bundle: the split kernel is the hopper (Gluon) one, the writers have PACKING set, no
    TensorRT-order kernels (linear only), the manifest records the packing; every serving kernel compiles for
    sm_90."""
    from oscar_export.kernels.aot.compile import build_bundle
    from oscar_export.kernels.aot.manifest import read_manifest

    layout, heads = LAYOUTS[name]
    specs = bundle.serving_specs(layout, heads, layout.head_dim ** -0.5, probes=False)
    by = {s.name.split("_h")[0]: s for s in specs}
    assert by["decode_split"].kernel.endswith(":_decode_split_gl_kernel")
    assert by["quant_pack_k"].constexpr_dict["PACKING"] == 1 and by["quant_pack_v"].constexpr_dict["PACKING"] == 2
    assert not any(s.name.startswith("trt_") for s in specs) and all(s.name.endswith("_mma16") for s in specs)
    with pytest.raises(NotImplementedError, match="linear pages only"):
        bundle.trt_specs(layout, heads, 0.125, "t")
    out = build_bundle([s for s in specs if not s.name.startswith("quant_pack_k_rot")], tmp_path / "b",
                       archs=["sm_90"], packing={"key": "mma16", "value": "mma16"})
    m = read_manifest(out)
    assert m.packing == {"key": "mma16", "value": "mma16"}
    assert m.entry(by["decode_split"].name, "sm_90").symbol == "_decode_split_gl_kernel"


def test_mma16_bundle_carries_the_gluon_kernel_for_sm90_only(tmp_path):
    """mma16 pages: the split kernel is the Gluon one (its plan, 4 warps), compiled into an sm_90 bundle; any other
    arch is refused with one clear error. ``serving_layout`` gives mma16 pages for sm_90 alone, linear otherwise."""
    from oscar_export.kernels.aot.compile import build_bundle, compile_kernel
    from oscar_export.kernels.aot.manifest import BundleError, read_manifest

    layout, heads = LAYOUTS["mma16_llama"]
    specs = bundle.serving_specs(layout, heads, layout.head_dim ** -0.5, probes=False)
    split = next(s for s in specs if s.name.startswith("decode_split"))
    assert split.kernel.endswith(":_decode_split_gl_kernel") and split.num_warps == 4
    assert split.constexpr_dict["STAGES"] == 3
    keep = [s for s in specs if s.name.startswith(("decode_split", "decode_merge"))]
    m = read_manifest(build_bundle(keep, tmp_path / "b", archs=["sm_90"], packing={"key": "mma16", "value": "mma16"}))
    assert m.entry(split.name, "sm_90").symbol == "_decode_split_gl_kernel"
    with pytest.raises(BundleError, match="runs on sm_90 \\(Hopper\\) only"):
        compile_kernel(split, "sm_80")
    lin, _ = LAYOUTS["d128_gqa4"]
    assert bundle.serving_layout(lin, ["sm_90"], heads, (2, 4)).packing == "mma16"
    assert bundle.serving_layout(layout, ["sm_80", "sm_90"], heads).packing == "linear"
    assert bundle.serving_layout(layout, ["sm_90"], heads, linear=True).packing == "linear"
