"""Where TensorRT-LLM keeps the names the adapter uses, in both source layouts (imported lazily).

"1.2" is the layout of the ``nvcr.io/nvidia/tensorrt-llm/release:1.2.1`` image the Dockerfile uses
(``tensorrt_llm/_torch/attention_backend/...``); "main" is the newer one (``tensorrt_llm/_torch/attention/
backends/...``, after upstream PR #17968). Everything else the adapter touches is at the same path in both:
the ``KVCacheManager`` (``_torch/pyexecutor/resource_manager.py``), the cache-manager dispatch
``get_kv_cache_manager_cls`` (``_torch/pyexecutor/_util.py``), ``register_auto_model``
(``_torch/models/modeling_utils.py``) and ``LlmRequestState`` (``_torch/pyexecutor/llm_request.py``, which
``py_executor.py`` imports it from). tests/plugins/trtllm_signatures.json records the signatures read.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

INSTALL_HINT = (
    "the OSCAR TensorRT-LLM adapter needs TensorRT-LLM's PyTorch backend (the nvcr.io/nvidia/tensorrt-llm/"
    "release:1.2.1 image, see the Dockerfile) and cuda-python"
)
ATTENTION_INTERFACE = {
    "1.2": "tensorrt_llm._torch.attention_backend.interface",
    "main": "tensorrt_llm._torch.attention.backends.interface",
}
RESOURCE_MANAGER = "tensorrt_llm._torch.pyexecutor.resource_manager"
LLM_REQUEST = "tensorrt_llm._torch.pyexecutor.llm_request"
EXECUTOR_UTIL = "tensorrt_llm._torch.pyexecutor._util"
MODELING_UTILS = "tensorrt_llm._torch.models.modeling_utils"


@dataclass(frozen=True)
class Upstream:
    """The TensorRT-LLM classes and modules of one installation."""

    layout: str
    AttentionBackend: Any
    AttentionMetadata: Any
    KVCacheManager: Any
    executor_util: ModuleType
    register_auto_model: Any
    LlmRequestState: Any


def resolve() -> Upstream:
    """Import TensorRT-LLM's names (main layout first, then 1.2); ``ImportError`` naming what to install."""
    errors = []
    for layout in ("main", "1.2"):
        try:
            iface = importlib.import_module(ATTENTION_INTERFACE[layout])
        except ImportError as e:
            errors.append(f"{ATTENTION_INTERFACE[layout]}: {e}")
            continue
        try:
            rm = importlib.import_module(RESOURCE_MANAGER)
            util = importlib.import_module(EXECUTOR_UTIL)
            mu = importlib.import_module(MODELING_UTILS)
            req = importlib.import_module(LLM_REQUEST)
        except ImportError as e:
            raise ImportError(f"{INSTALL_HINT} ({e})") from e
        return Upstream(layout, iface.AttentionBackend, iface.AttentionMetadata, rm.KVCacheManager, util,
                        mu.register_auto_model, req.LlmRequestState)
    raise ImportError(f"{INSTALL_HINT} ({'; '.join(errors)})")


__all__ = ["ATTENTION_INTERFACE", "EXECUTOR_UTIL", "INSTALL_HINT", "LLM_REQUEST", "MODELING_UTILS", "RESOURCE_MANAGER",
           "Upstream", "resolve"]
