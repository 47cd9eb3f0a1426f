"""The decode step's kernels compiled ahead, in worker processes, while the prompt is prefilled and the step traced.

The README loop's first compiled call spends its time in Dynamo, Inductor and then, in the graph's first run, in
the Triton / Gluon JIT of the cache's own kernels: one append and one decode kernel per distinct layer format (the
key width, the transform's identity flags), compiled one after the other (on an H200's host: the 4-bit-key
append kernel 4.5 s, the Gluon decode kernel 1.1-1.7 s; ``benchmarks/bench_e2e.py`` reports the README loop's first
run as ``first_run_s``). Inductor cannot compile them in its worker pool: the
custom ops are opaque to it (``kernels/triton_ops.py``).

So when a cache is made on a GPU with the triton backend, :func:`start` writes each distinct layer format
(:class:`StepFormat`) to a file and starts one worker per format, ``python -m oscar_export.plugins.hf.precompile
FILE I`` (a fresh interpreter: nothing of the user's script runs again in it). The worker runs one decode step of
format ``I`` through the same ``triton_backend`` calls as a real step (``prepare``, ``decode_append``,
``decode_attention``) on scratch buffers of the same shapes, dtypes and launch sizes (empty lengths, a one-page
pool), so Triton compiles the same specialisations and writes them into its on-disk cache (``TRITON_CACHE_DIR``,
inherited), where the main process's first launch finds them. Workers run side by side; the main process goes on.

Nothing waits for them: the first launch of a kernel (a compiled step's first run, after Dynamo and Inductor; an
eager step, after the prefill) finds it on disk if its worker is done, and otherwise compiles it itself, as without
this module (Triton writes a cache entry atomically, so two writers of one entry are harmless). Waiting in an eager
step could be slower than compiling there: a worker first starts an interpreter and a CUDA context. A worker that
fails changes nothing else (:meth:`Precompile.wait` reports it; tests wait). Workers outlive nothing they need: a
parent that exits leaves them to finish their compile and exit.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepFormat:
    """What fixes the kernels one layer's decode step compiles: its layout, its transform (CPU; only which parts
    are the identity matters), the cache's batch and block-table width, the model's query heads, window dtype and
    softmax scale (a constant of the decode kernel)."""

    layout: KVCacheLayout
    transform: LayerTransform
    batch: int
    max_pages: int
    num_heads: int
    dtype: torch.dtype
    scale: float


#: the formats this process has started workers for, per device (a second cache of the same formats starts none:
#: Triton already holds or is writing their kernels)
_STARTED: set[tuple] = set()


def formats(cache, scale: float) -> list[StepFormat]:
    """The distinct decode-step formats of ``cache``'s OSCAR layers (one per layout and transform flags)."""
    out: dict[tuple, StepFormat] = {}
    for layer in cache.oscar_layers:
        key = (layer.layout, layer.flags, layer.dtype)
        if key not in out:
            out[key] = StepFormat(layer.layout, layer.transform.to("cpu"), cache.book.batch, cache.book.max_pages,
                                  cache.num_heads, layer.dtype, float(scale))
    return list(out.values())


def _key(fmt: StepFormat, device: torch.device) -> tuple:
    from .oscar_layer import TransformFlags

    return (fmt.layout, TransformFlags.of(fmt.transform), fmt.batch, fmt.max_pages, fmt.num_heads, fmt.dtype,
            fmt.scale, device)


def run_step(fmt: StepFormat, device: torch.device | str) -> None:
    """One decode step of format ``fmt`` on scratch buffers of ``device``: every kernel it launches is compiled."""
    from . import triton_backend
    from .attention import rotate_values
    from .oscar_layer import TransformFlags

    device = torch.device(device)
    lay = fmt.layout
    state = PagedKV.allocate(lay, fmt.batch, 1, fmt.max_pages, device=device, dtype=fmt.dtype)
    transform = fmt.transform.to(device)
    status = torch.zeros(fmt.batch, dtype=torch.int32, device=device)
    cache = SimpleNamespace(num_heads=fmt.num_heads, book=SimpleNamespace(status=status))
    layer = SimpleNamespace(layout=lay, transform=transform, flags=TransformFlags.of(transform), dtype=fmt.dtype,
                            device=device, batch_size=fmt.batch, state=state, step_state=state, cache=cache)
    triton_backend.prepare(layer)
    kv = torch.zeros(fmt.batch, lay.num_kv_heads, 1, lay.head_dim, dtype=fmt.dtype, device=device)  # [B, H_kv, 1, D]
    q = torch.zeros(fmt.batch, fmt.num_heads, lay.head_dim, dtype=fmt.dtype, device=device)  # [B, H, D]
    # the arguments attention._decode passes: contiguous key rows, the values as rotate_values leaves them
    q_s = triton_backend.decode_append(layer, state, kv[:, :, 0].contiguous(), rotate_values(layer, kv[:, :, 0]), q,
                                       status)
    triton_backend.decode_attention(layer, q_s, state, fmt.scale)


class Precompile:
    """The workers of one cache (:func:`start`)."""

    def __init__(self, procs: list[subprocess.Popen], folder: tempfile.TemporaryDirectory) -> None:
        self.procs = procs
        self._folder = folder
        self.started = time.perf_counter()

    def wait(self) -> list[str]:
        """Wait for every worker (idempotent); the failures, one line each (also logged)."""
        failed = []
        for p in self.procs:
            out, _ = p.communicate()
            if p.returncode:
                failed.append(f"worker {p.args[-2]} exited {p.returncode}: {(out or b'').decode(errors='replace')}")
                log.debug("oscar precompile %s", failed[-1][-2000:])
        self.procs = []
        self._folder.cleanup()
        return failed


def start(fmts: list[StepFormat], device: torch.device) -> Precompile | None:
    """Start one worker process per format on ``device`` (a CUDA device); None when there is nothing to do or the
    workers cannot start (logged: the main process then compiles on its first launch)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    fmts = [f for f in fmts if _key(f, index) not in _STARTED]
    if not fmts:
        return None
    folder = tempfile.TemporaryDirectory(prefix="oscar-precompile-")
    path = os.path.join(folder.name, "formats.pt")
    try:
        torch.save(fmts, path)
        procs = [subprocess.Popen([sys.executable, "-m", __name__, path, str(i), str(index)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(len(fmts))]
    except OSError as e:
        log.debug("oscar precompile: workers not started (%s)", e)
        folder.cleanup()
        return None
    _STARTED.update(_key(f, index) for f in fmts)
    return Precompile(procs, folder)


def _main(argv: list[str]) -> int:
    path, i, index = argv[0], int(argv[1]), int(argv[2])
    fmt = torch.load(path, weights_only=False)[i]
    t0 = time.perf_counter()
    torch.cuda.set_device(index)
    run_step(fmt, torch.device("cuda", index))
    torch.cuda.synchronize()
    print(f"format {i}: compiled in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
