"""``KernelSpec`` and ``Param`` (kernels/aot/spec.py): what a bundle entry names, the register cap it carries, and
the specs it refuses."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from oscar_export.kernels.aot.probe import probe_specs  # noqa: E402
from oscar_export.kernels.aot.spec import KernelSpec, Param  # noqa: E402

from helpers import hopper_split_spec  # noqa: E402


def test_spec_matches_kernel_and_grid_rule():
    spec = probe_specs()[0]
    fn = spec.jit_function()
    assert spec.signature(fn) == {"codes_ptr": "*u8", "out_ptr": "*u8", "rows": "i32", "D": "constexpr",
                                  "G": "constexpr", "BLOCK_R": "constexpr"}
    assert spec.grid_for({"rows": 33}) == (3, 1, 1)  # cdiv(33, 16)
    assert KernelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_spec_rejects_float_scalar():
    with pytest.raises(ValueError, match="float runtime scalars are not allowed"):
        Param("sm_scale", "fp32")


def test_spec_rejects_unknown_type():
    with pytest.raises(ValueError, match="expected one of"):
        Param("x", "*f32")


@pytest.mark.parametrize("expr", ["__import__('os')", "rows ** 2", "rows / 2", "other + 1", "1.5"])
def test_spec_rejects_bad_grid_expressions(expr):
    base = probe_specs()[0]
    with pytest.raises(ValueError, match="grid expression"):
        KernelSpec(base.name, base.kernel, base.params, base.constexprs, (expr, "1", "1"))


def test_spec_rejects_empty_grid_and_missing_value():
    spec = probe_specs()[0]
    with pytest.raises(ValueError, match="empty dimension"):
        spec.grid_for({"rows": 0})
    with pytest.raises(ValueError, match="needs a value for 'rows'"):
        spec.grid_for({})


def test_spec_rejects_params_not_matching_kernel():
    base = probe_specs()[0]
    wrong = KernelSpec(base.name, base.kernel, base.params[::-1], base.constexprs, base.grid)
    with pytest.raises(ValueError, match="do not match runtime params"):
        wrong.jit_function()
    missing = KernelSpec(base.name, base.kernel, base.params, base.constexprs[:1], base.grid)
    with pytest.raises(ValueError, match="do not match"):
        missing.jit_function()


def test_spec_rejects_bad_names():
    base = probe_specs()[0]
    with pytest.raises(ValueError, match="KernelSpec.name"):
        KernelSpec("a/b", base.kernel, base.params, base.constexprs, base.grid)
    with pytest.raises(ValueError, match="module:attr"):
        KernelSpec("a", "no_colon", base.params, base.constexprs, base.grid)
    with pytest.raises(ValueError, match="not a @triton.jit function"):
        KernelSpec("a", "oscar_export.kernels.aot.probe:probe_specs", base.params, base.constexprs,
                   base.grid).jit_function()


def test_the_register_cap_is_the_plans_and_travels_in_the_manifest():
    """head_dim <= 128 is capped at GL_MAXNREG (4 CTAs an SM), 256 is not; the cap survives to_dict/from_dict and
    a hostile value is refused."""
    from dataclasses import replace

    from oscar_export.kernels.aot.launch_plan import GL_MAXNREG
    from oscar_export.kernels.aot.spec import KernelSpec

    capped, free = hopper_split_spec("token", 128, 128, 4), hopper_split_spec("token", 256, 64, 16)
    assert (capped.maxnreg, free.maxnreg) == (GL_MAXNREG, 0)
    assert KernelSpec.from_dict(capped.to_dict()) == capped and "maxnreg" not in free.to_dict()
    assert KernelSpec.from_dict(free.to_dict()) == free
    for bad in (1, 300, -8):
        with pytest.raises(ValueError, match="maxnreg"):
            replace(capped, maxnreg=bad)
