"""How many torch threads a CPU run of ``generate`` or ``eval`` uses: torch's own choice (every core), or one
where other processes already keep every core busy.

Measured on a 2-core machine at load 9-12 (SmolLM2, a 703-token prompt, 64 greedy tokens): two threads spun
against the other processes at 1,530 ms a decode step with the fp32 cache and 4,614 ms with OSCAR, one thread at
240 and 478 ms. On an idle machine torch's default (every core) is left alone.
"""

from __future__ import annotations

import contextlib
import os


def cpu_threads(default: int) -> int:
    """One where the 1-minute load average is at least the number of cores (the cores are taken), else ``default``."""
    cores = os.cpu_count() or 1
    return 1 if cores > 1 and os.getloadavg()[0] >= cores else default


@contextlib.contextmanager
def cpu_run_threads(device: str):
    """Set the torch threads for a run on ``device`` (:func:`cpu_threads` on the CPU; CUDA runs are left alone),
    yield the count, and give the previous count back afterwards."""
    import torch

    before = torch.get_num_threads()
    if str(device).startswith("cpu"):
        torch.set_num_threads(cpu_threads(before))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
