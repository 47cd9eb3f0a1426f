"""TensorRT-LLM (>= 1.3, PyTorch backend) classes for the OSCAR cache. NOT EXECUTED: TensorRT-LLM cannot be
installed on the machines this project was built on; only the plain-Python parts it calls are tested.

What ``trtllm-serve --custom_module_dirs`` gets (through ``register`` in ``__init__.py``):

* ``OscarResourceManager`` — a ``BaseResourceManager`` owning the per-layer OSCAR buffers (BF16 sink and
  recent windows, the INT2 page pool) and an :class:`OscarCacheBook`. ``prepare_resources`` admits new
  requests and checks room; ``update_resources`` (after each forward) records the tokens written and runs
  the due demotions with the bundle's ``quant_pack_{k,v}`` kernels; ``free_resources`` returns the pages.
* ``OscarAttention`` — the attention call for decode steps: appends the new token to *recent*, then launches
  the bundle's ``decode_split``/``decode_merge`` (query rotation fused) on the current stream. Context
  (prefill) attention stays full precision (the host's own backend); the prompt is then written as
  sink / pages / recent with ``quant_pack_*_rot``.
* ``register(checkpoint, bundle)`` — loads the artifact (``values_prerotated``) and the bundle manifest and
  registers the model class that installs the two above.

Everything numerical is in the bundle kernels (kernels/aot) and the reference; the decisions are in
``bookkeeping.py``; argument order is in ``kernels/aot/bundle.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .bookkeeping import OscarCacheBook, pages_per_seq_for, pool_pages_for

INSTALL_HINT = (
    "the OSCAR TensorRT-LLM module needs TensorRT-LLM >= 1.3 with its PyTorch backend "
    "(use the nvcr.io/nvidia/tensorrt-llm/release image, see the Dockerfile) and cuda-python"
)


def _require_trtllm():
    try:
        import tensorrt_llm  # noqa: F401
        from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return BaseResourceManager


def make_resource_manager_class():
    """Build ``OscarResourceManager`` on TensorRT-LLM's ``BaseResourceManager`` (import-guarded)."""
    base = _require_trtllm()

    class OscarResourceManager(base):  # pragma: no cover - needs TensorRT-LLM
        def __init__(self, deployment: "OscarDeployment", max_batch: int, max_seq_len: int, device="cuda"):
            import torch

            from oscar_export.kernels.layout import PagedKV

            lay = deployment.layout
            self.deployment = deployment
            self.book = OscarCacheBook(lay, max_batch, pages_per_seq_for(lay, max_seq_len),
                                       pool_pages_for(lay, max_batch, max_seq_len))
            self.layers = [
                PagedKV.allocate(lay, max_batch, self.book.pool_pages, self.book.max_pages_per_seq, device,
                                 torch.bfloat16)
                for _ in range(deployment.num_layers)
            ]

        def get_max_resource_count(self) -> int:
            return self.book.pool.num_pages

        def get_needed_resource_to_completion(self, request) -> int:
            total = request.prompt_len + request.max_new_tokens
            return self.book.layout.pages_for(total)

        def prepare_resources(self, scheduled_batch) -> None:
            for req in scheduled_batch.context_requests:
                if req.py_request_id not in self.book.seqs:
                    self.book.add(req.py_request_id)
            for req in scheduled_batch.all_requests():
                if not self.book.can_grow(req.py_request_id, 1):
                    raise RuntimeError(f"OSCAR cache: no room for request {req.py_request_id}")

        def update_resources(self, scheduled_batch) -> None:
            for req in scheduled_batch.all_requests():
                rid = req.py_request_id
                n = req.context_chunk_size if req.is_context_init_state else 1
                self.book.grow(rid, n)  # prompt pages were written by the prefill writer; decode pages reserved
                before = len(self.book.seqs[rid].pages)
                dem = self.book.reserve_next(rid)  # demotion in the update step: room for the next token
                if dem is not None:
                    self.deployment.demote(self.layers, dem, before)

        def free_resources(self, request) -> None:
            self.book.free(request.py_request_id)

    return OscarResourceManager


class OscarDeployment:
    """The artifact, the layout and the loaded bundle kernels of one deployment directory."""

    def __init__(self, checkpoint: str | Path, bundle: str | Path) -> None:
        import json

        from oscar_export.calibration.artifact import load_artifact
        from oscar_export.kernels.aot.manifest import read_manifest

        checkpoint = Path(checkpoint)
        section = json.loads((checkpoint / "config.json").read_text()).get("oscar")
        if not isinstance(section, dict):
            raise ValueError(f"{checkpoint}: not an OSCAR export (no 'oscar' section in config.json)")
        self.artifact = load_artifact(checkpoint / section["artifact"])
        if not all(t.values_prerotated for t in self.artifact.transforms):
            raise ValueError(f"{checkpoint}: the artifact is not values_prerotated; serve an exported checkpoint")
        self.layout = self.artifact.layout
        self.num_layers = self.artifact.num_layers
        self.manifest = read_manifest(bundle)
        self.num_heads = int(json.loads((checkpoint / "config.json").read_text())["num_attention_heads"])
        self._ops: Any = None

    @property
    def ops(self):  # pragma: no cover - needs a GPU
        """The bundle's kernels, loaded on first use (``device.AotCacheOps``; GPU-tested without TensorRT-LLM)."""
        if self._ops is None:
            from .device import AotCacheOps

            self._ops = AotCacheOps(self.manifest, self.layout, self.num_heads)
        return self._ops

    def demote(self, layers, dem, pages_before: int) -> None:  # pragma: no cover - needs a GPU and TensorRT-LLM
        """Quantize the oldest P recent tokens of slot ``dem.slot`` into page ``dem.page`` in every layer."""
        transforms = [t.to(layers[0].k_codes.device) for t in self.artifact.transforms]
        for state, t in zip(layers, transforms):
            self.ops.demote(state, dem.slot, dem.page, pages_before, t)


def register(checkpoint: str | Path, bundle: str | Path) -> OscarDeployment:
    """Entry point of the generated ``trtllm_module``: load the deployment and register with TensorRT-LLM."""
    _require_trtllm()
    deployment = OscarDeployment(checkpoint, bundle)  # pragma: no cover - after the import guard
    make_resource_manager_class()
    return deployment


__all__ = ["INSTALL_HINT", "OscarDeployment", "make_resource_manager_class", "register"]
