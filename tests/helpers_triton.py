"""Triton kernels where they can run: compiled on a GPU, interpreted on the CPU (tests/kernels, tests/plugins)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from types import ModuleType

import pytest
import torch

# Triton decides at import time whether ``@triton.jit`` functions (its own ``tl.max``/``tl.sum`` included) are
# interpreted (``TRITON_INTERPRET=1``), so one process cannot hold both modes, and the AOT tests need the compiled
# mode on the CPU. Without a GPU, the first test of a kernel test file therefore runs that whole file once in a
# child pytest process with ``TRITON_INTERPRET=1``; each test of the parent then reports its own outcome from the
# child (failures with the child's output). Library code never reads the variable; only this harness sets it, in
# the child's environment.

#: this process runs Triton kernels through the interpreter (the child of :func:`kernel_module`)
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


def kernel_module(request: pytest.FixtureRequest, name: str) -> ModuleType:
    """``oscar_export.kernels.<name>`` for a test that launches its kernels (a fixture's body): the module on a GPU or
    in the interpreted child; else the test ends here with its outcome in the child (see the comment above)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or INTERPRETED:
        return importlib.import_module(f"oscar_export.kernels.{name}")
    outcomes, out = _run_child(str(request.node.path), request.config.getoption("markexpr", "") or "")
    status = outcomes.get(request.node.name)
    if status == "PASSED":
        pytest.skip("passed in the TRITON_INTERPRET=1 child process (see tests/helpers_triton.py: kernel_module)")
    if status == "SKIPPED":
        pytest.skip("skipped in the TRITON_INTERPRET=1 child process")
    pytest.fail(f"{status or 'no result'} in the TRITON_INTERPRET=1 child process:\n{out[-6000:]}", pytrace=False)


def kernel_fixture(name: str, what: str = ""):
    """A pytest fixture (assign it to the fixture's name in a conftest) giving :func:`kernel_module` ``(request,
    name)``: ``oscar_export.kernels.<name>`` as it runs here; ``what`` ends its docstring."""

    def fixture(request: pytest.FixtureRequest) -> ModuleType:
        return kernel_module(request, name)

    fixture.__doc__ = f"``kernels.{name}`` as it runs here (``helpers.kernel_module``){what}."
    return pytest.fixture(fixture)
