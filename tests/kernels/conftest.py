"""Run the Triton kernel tests where they can run: compiled on a GPU, interpreted on the CPU.

Triton decides at import time whether ``@triton.jit`` functions (its own ``tl.max``/``tl.sum`` included)
are interpreted (``TRITON_INTERPRET=1``), so one process cannot hold both modes, and the AOT tests in this
folder need the compiled mode on the CPU. Without a GPU, the first test of a kernel test file therefore
runs that whole file once in a child pytest process with ``TRITON_INTERPRET=1``; each test of the parent
then reports its own outcome from the child (failures with the child's output). Library code never reads
the variable; only this test harness sets it, in the child's environment.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from types import ModuleType

import pytest
import torch

from helpers import build_probe_bundle

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


_child_results: dict[str, tuple[dict[str, str], str]] = {}


def _run_child(path: str, markexpr: str) -> tuple[dict[str, str], str]:
    """Run one test file under the interpreter; ``({test name: PASSED/FAILED/...}, output)``."""
    if path not in _child_results:
        env = dict(os.environ, TRITON_INTERPRET="1")
        marks = f"({markexpr}) and not gpu" if markexpr else "not gpu"
        cmd = [sys.executable, "-m", "pytest", path, "-q", "-rA", "-p", "no:cacheprovider", "-m", marks]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        out = proc.stdout + proc.stderr
        outcomes = {}
        for m in re.finditer(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\S* (\S+::\S+)", out, re.M):
            outcomes[m.group(2).split("::", 1)[1]] = m.group(1)
        _child_results[path] = (outcomes, out)
    return _child_results[path]


def _kernel_module(request: pytest.FixtureRequest, name: str) -> ModuleType:
    pytest.importorskip("triton")
    if torch.cuda.is_available() or INTERPRETED:
        return importlib.import_module(f"oscar_export.kernels.{name}")
    outcomes, out = _run_child(str(request.node.path), request.config.getoption("markexpr", "") or "")
    status = outcomes.get(request.node.name)
    if status == "PASSED":
        pytest.skip("passed in the TRITON_INTERPRET=1 child process (see tests/kernels/conftest.py)")
    if status == "SKIPPED":
        pytest.skip("skipped in the TRITON_INTERPRET=1 child process")
    pytest.fail(f"{status or 'no result'} in the TRITON_INTERPRET=1 child process:\n{out[-6000:]}", pytrace=False)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: CUDA when present, else the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def qp(request) -> ModuleType:
    """``kernels.quant_pack`` as it runs here (see the module doc)."""
    return _kernel_module(request, "quant_pack")


@pytest.fixture
def ds(request) -> ModuleType:
    """``kernels.decode_step`` as it runs here (see the module doc)."""
    return _kernel_module(request, "decode_step")


@pytest.fixture
def da(request) -> ModuleType:
    """``kernels.decode.portable`` as it runs here (see the module doc)."""
    return _kernel_module(request, "decode.portable")


@pytest.fixture
def ct_mod(request) -> ModuleType:
    """``kernels.clip_threshold`` as it runs here (see the module doc): its helpers in a test file's own kernel."""
    return _kernel_module(request, "clip_threshold")


@pytest.fixture
def pp_mod(request) -> ModuleType:
    """``kernels.decode.portable_pages`` as it runs here (see the module doc): its helpers in a test file's kernel."""
    return _kernel_module(request, "decode.portable_pages")


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    """The probe kernels' bundle (kernels/aot/probe.py) for every target, built once for the AOT tests
    (test_aot_compile.py, test_aot_manifest.py, test_aot_launcher.py); skipped without Triton."""
    pytest.importorskip("triton")
    root = tmp_path_factory.mktemp("aot")
    return build_probe_bundle(root / "bundle", root / "cache")
