"""TensorRT-LLM (PyTorch backend) classes for the OSCAR cache.

NOT EXECUTED: TensorRT-LLM cannot be installed on the machines this project was built on. The TensorRT-LLM
names used here (``BaseResourceManager`` hooks, ``AttentionBackend.forward(q, k, v, metadata)`` with packed
``[tokens, heads * D]`` inputs, ``metadata.seq_lens`` / ``request_ids`` / ``kv_cache_params``) follow its
public source as read, not as run. What IS tested: the decisions (``bookkeeping.py``, pure Python) and the
device operations these classes call (``device.AotCacheOps``: prefill, append, demotion and decode through
the AOT bundle, compared with the reference and the Triton JIT on an H200 in tests/gpu/test_aot_gpu.py,
including a whole prefill + 140-step serving sequence driven exactly as below).

One step of the executor, and who does what:

1. ``OscarResourceManager.prepare_resources``: admit new requests (a batch slot each) and, for a context
   (prefill) request, ``book.grow(prompt_len)``: the pages its prompt fills.
2. ``OscarAttention.forward`` (every layer): context requests attend at full precision (causal SDPA) and
   write the prompt (``AotCacheOps.prefill``: sink, INT2 pages, recent); generation requests append their
   token to *recent* (``append``, position from ``book.split``) and attend over sink + INT2 + recent with
   the bundle's decode kernels (query rotation fused, output in the stored value basis: the exported
   ``o_proj`` undoes the value rotation; the value mean is added back here).
3. ``OscarResourceManager.update_resources``: ``book.grow(1)`` for each generation token, then the
   demotion for each continuing request (``book.reserve_next`` + ``AotCacheOps.demote`` in every layer),
   so the next forward always finds a free recent slot.
4. ``free_resources``: the request's pages go back to the pool.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .bookkeeping import OscarCacheBook, pages_per_seq_for, pool_pages_for

INSTALL_HINT = (
    "the OSCAR TensorRT-LLM module needs TensorRT-LLM (PyTorch backend; use the "
    "nvcr.io/nvidia/tensorrt-llm/release image, see the Dockerfile) and cuda-python"
)


def _require_trtllm():
    try:
        import tensorrt_llm  # noqa: F401
        from tensorrt_llm._torch.attention_backend.interface import AttentionBackend, AttentionMetadata
        from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return BaseResourceManager, AttentionBackend, AttentionMetadata


class OscarDeployment:
    """The artifact (``values_prerotated``), the layout and the bundle of one deployment directory."""

    def __init__(self, checkpoint: str | Path, bundle: str | Path) -> None:
        from oscar_export.calibration.artifact import load_artifact
        from oscar_export.kernels.aot.manifest import read_manifest

        checkpoint = Path(checkpoint)
        config = json.loads((checkpoint / "config.json").read_text())
        section = config.get("oscar")
        if not isinstance(section, dict):
            raise ValueError(f"{checkpoint}: not an OSCAR export (no 'oscar' section in config.json)")
        self.artifact = load_artifact(checkpoint / section["artifact"])
        if not all(t.values_prerotated for t in self.artifact.transforms):
            raise ValueError(f"{checkpoint}: the artifact is not values_prerotated; serve an exported checkpoint")
        self.layout = self.artifact.layout
        self.num_layers = self.artifact.num_layers
        self.num_heads = int(config["num_attention_heads"])
        self.manifest = read_manifest(bundle)
        self._ops: Any = None
        self._transforms: Any = None

    def ops(self):  # pragma: no cover - needs a GPU
        if self._ops is None:
            from .device import AotCacheOps

            self._ops = AotCacheOps(self.manifest, self.layout, self.num_heads)
        return self._ops

    def transform(self, layer: int, device):  # pragma: no cover - needs a GPU
        if self._transforms is None:
            self._transforms = [t.to(device) for t in self.artifact.transforms]
        return self._transforms[layer]


def make_classes(deployment: OscarDeployment):  # pragma: no cover - needs TensorRT-LLM
    """``(OscarResourceManager, OscarAttention)`` built on TensorRT-LLM's base classes (import-guarded)."""
    BaseResourceManager, AttentionBackend, AttentionMetadata = _require_trtllm()
    import torch

    lay = deployment.layout

    class OscarResourceManager(BaseResourceManager):
        def __init__(self, max_batch: int, max_seq_len: int, device="cuda"):
            from oscar_export.kernels.layout import PagedKV

            self.book = OscarCacheBook(lay, max_batch, pages_per_seq_for(lay, max_seq_len),
                                       pool_pages_for(lay, max_batch, max_seq_len))
            self.layers = [
                PagedKV.allocate(lay, max_batch, self.book.pool_pages, self.book.max_pages_per_seq, device,
                                 torch.bfloat16)
                for _ in range(deployment.num_layers)
            ]
            self.prompt_pages: dict[int, list[int]] = {}

        def get_max_resource_count(self) -> int:
            return self.book.pool.num_pages

        def get_needed_resource_to_completion(self, request) -> int:
            return lay.pages_for(request.prompt_len + request.max_new_tokens)

        def prepare_resources(self, scheduled_batch) -> None:
            for req in scheduled_batch.context_requests:
                rid = req.py_request_id
                if rid not in self.book.seqs:
                    self.book.add(rid)
                self.prompt_pages[rid] = [d.page for d in self.book.grow(rid, req.context_chunk_size)]

        def update_resources(self, scheduled_batch) -> None:
            for req in scheduled_batch.generation_requests:
                self.book.grow(req.py_request_id, 1)
            for req in scheduled_batch.all_requests():
                rid = req.py_request_id
                self.prompt_pages.pop(rid, None)
                before = len(self.book.seqs[rid].pages)
                dem = self.book.reserve_next(rid)
                if dem is not None:
                    for i, state in enumerate(self.layers):
                        deployment.ops().demote(state, dem.slot, dem.page, before, deployment.transform(i, state.k_codes.device))

        def free_resources(self, request) -> None:
            self.book.free(request.py_request_id)

    class OscarAttentionMetadata(AttentionMetadata):
        pass

    class OscarAttention(AttentionBackend[OscarAttentionMetadata]):
        Metadata = OscarAttentionMetadata

        def forward(self, q, k, v, metadata, **kwargs):
            mgr = metadata.kv_cache_manager  # the OscarResourceManager
            state = mgr.layers[self.layer_idx]
            t = deployment.transform(self.layer_idx, q.device)
            h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            out = torch.empty_like(q)
            offset, decode_rows = 0, []
            cached = metadata.kv_cache_params.num_cached_tokens_per_seq
            for i, (rid, n) in enumerate(zip(metadata.request_ids, metadata.seq_lens.tolist())):
                qi = q[offset : offset + n].view(n, h, d).transpose(0, 1)  # [H, n, D]
                ki = k[offset : offset + n].view(n, hkv, d).transpose(0, 1)  # [H_kv, n, D]
                vi = v[offset : offset + n].view(n, hkv, d).transpose(0, 1)
                seq = mgr.book.seqs[rid]
                k_s = t.transform_keys(ki[None])[0].to(torch.bfloat16)  # stored basis [H_kv, n, D]
                v_s = t.transform_values(vi[None])[0].to(torch.bfloat16)
                if cached[i] == 0:  # prompt: full precision, then written to the cache
                    o = torch.nn.functional.scaled_dot_product_attention(
                        qi[None], ki[None], vi[None], is_causal=True, enable_gqa=True)[0]
                    out[offset : offset + n] = o.transpose(0, 1).reshape(n, h * d)
                    deployment.ops().prefill(state, seq.slot, k_s, v_s, mgr.prompt_pages[rid], t)
                else:
                    deployment.ops().append(state, seq.slot, mgr.book.split(rid), k_s[:, 0], v_s[:, 0])
                    decode_rows.append((offset, seq.slot, qi[:, 0]))
                offset += n
            if decode_rows:
                qb = torch.zeros(mgr.book.max_batch, h, d, dtype=torch.bfloat16, device=q.device)
                for _, slot, qr in decode_rows:
                    qb[slot] = qr
                ob = deployment.ops().decode(qb, state, t, pages_per_split=8)  # [max_batch, H, D], stored basis
                ob = t.restore_output(ob[:, :, None]).squeeze(2)  # + v_mean (R_V is folded into o_proj)
                for off, slot, _ in decode_rows:
                    out[off] = ob[slot].reshape(h * d).to(out.dtype)
            return out

    return OscarResourceManager, OscarAttention


def register(checkpoint: str | Path, bundle: str | Path) -> OscarDeployment:
    """Entry point of the generated ``trtllm_module``: load the deployment and build the TensorRT-LLM classes.

    Selecting them inside the executor (the attention backend of the served model and the resource manager
    for the KV cache) is done by the TensorRT-LLM configuration of the deployment; that wiring is the part
    that most needs a real TensorRT-LLM to get right and was not executed.
    """
    _require_trtllm()
    deployment = OscarDeployment(checkpoint, bundle)  # pragma: no cover - after the import guard
    deployment.classes = make_classes(deployment)
    return deployment


__all__ = ["INSTALL_HINT", "OscarDeployment", "make_classes", "register"]
