"""What the first compiled call of ``bench_e2e.py``'s step costs: Dynamo's phase timers, the kernels it JIT-compiled
into Triton's cache folder, and the fresh empty cache folders a run starts from (a new machine's compile)."""

from __future__ import annotations

import os
import tempfile


def compile_split(compile_s: float) -> dict:
    """``compile_s`` of a first compiled call split by Dynamo's own timers (``torch._dynamo.utils``, cleared before
    the call): ``dynamo_s``, ``inductor_s`` (the backend compiler) and ``first_run_s`` (the rest), and every timer
    of 0.05 s or more (``compile_timers``: nested phases, seconds summed over calls); {} if this torch has no such
    timers."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as timers
    except ImportError:
        return {}
    whole = sum(timers.get("_compile.compile_inner", ()))
    backend = sum(timers.get("OutputGraph.call_user_compiler", ()))
    if not whole:
        return {}
    return {"dynamo_s": whole - backend, "inductor_s": backend, "first_run_s": compile_s - whole,
            "compile_timers": {k: round(sum(v), 3) for k, v in sorted(timers.items()) if sum(v) >= 0.05}}


def clear_compile_timers() -> None:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return
    compilation_time_metrics.clear()


def triton_binaries() -> set[str]:
    """The compiled kernels (``.cubin``) in Triton's cache folder."""
    folder = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    return {os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".cubin")}


def fresh_caches() -> None:
    """Point Triton and Inductor at empty cache folders, before anything compiles (Inductor's compile workers
    inherit the environment; Triton reads ``TRITON_CACHE_DIR`` at each compile)."""
    fresh = tempfile.mkdtemp(prefix="bench_e2e_caches_")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(fresh, "inductor")
