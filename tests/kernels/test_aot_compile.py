"""Ahead-of-time compilation on the CPU (kernels/aot/compile.py): the arch gate, the bundle of every kernel for every
target, reproducibility, the refusals of ``build_bundle``.

The probe kernels (kernels/aot/probe.py) are compiled for every target (the ``bundle`` fixture of
tests/kernels/conftest.py); the serving kernels' bundle is tested in test_aot_bundle.py. Running the binaries needs a
GPU: tests/gpu/test_aot_gpu.py.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from oscar_export.kernels.aot.compile import DEFAULT_ARCHS, build_bundle, compile_kernel  # noqa: E402
from oscar_export.kernels.aot.manifest import (  # noqa: E402
    MANIFEST,
    SHARED_LIMIT,
    parse_arch,
    ptx_entry_params,
    read_manifest,
)
from oscar_export.kernels.aot.probe import probe_specs  # noqa: E402
from oscar_export.kernels.aot.spec import KernelSpec  # noqa: E402

from helpers import build_probe_bundle  # noqa: E402


def test_unknown_arch_is_rejected():
    with pytest.raises(ValueError, match="unknown GPU arch 'sm_75'"):
        parse_arch("sm_75")
    with pytest.raises(ValueError, match="unknown GPU arch"):
        compile_kernel(probe_specs()[0], "sm_100")


# ---- the compiled bundle ----------------------------------------------------------------------------------------


def test_bundle_holds_every_kernel_for_every_target(bundle):
    m = read_manifest(bundle)  # verifies sha256, symbols and PTX parameter counts
    assert m.archs() == sorted(DEFAULT_ARCHS)
    assert sorted({e.name for e in m.entries}) == sorted(s.name for s in probe_specs())
    assert len(m.entries) == len(probe_specs()) * len(DEFAULT_ARCHS)
    for e in m.entries:
        ptx = (bundle / e.ptx_file).read_text()
        assert ptx_entry_params(ptx, e.symbol) == len(e.spec.params) + 2, e.name
        assert f".target sm_{e.arch}" in ptx
        assert ".version 8.8" in ptx
        assert ".file" not in ptx  # no source paths: reproducible across checkouts
        assert 0 <= e.shared <= SHARED_LIMIT[e.arch]
        assert all(p["type"] in ("i32",) or p["type"].startswith("*") for p in e.spec.to_dict()["params"])
    data = json.loads((bundle / MANIFEST).read_text())
    assert str(bundle) not in json.dumps(data)  # no absolute paths in the manifest


def test_scratch_sizes_are_zero():
    ck = compile_kernel(probe_specs()[1], "sm_90")
    assert ck.entry.shared <= SHARED_LIMIT[90]
    # the gate raises otherwise; check the metadata it read is really there by recompiling a spec
    assert ck.cubin[:4] == b"\x7fELF"


def test_build_is_byte_reproducible(bundle, tmp_path):
    again = build_probe_bundle(tmp_path / "again", tmp_path / "cache2")  # fresh cache: a real second compile
    files = sorted(p.name for p in bundle.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    diff = [f for f in files if (bundle / f).read_bytes() != (again / f).read_bytes()]
    assert not diff, f"files differ between two builds: {diff}"


def test_build_refuses_existing_output_and_leaves_nothing_on_failure(tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        build_bundle(probe_specs(), tmp_path / "exists")
    bad = probe_specs()[0]
    bad = KernelSpec(bad.name, bad.kernel, bad.params[::-1], bad.constexprs, bad.grid)
    with pytest.raises(ValueError):
        build_bundle([bad], tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]  # no temp dir, no partial bundle
