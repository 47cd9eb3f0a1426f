"""Stand-ins for the TensorRT-LLM classes the OSCAR adapter touches, placed under their real dotted module names.

TensorRT-LLM cannot be imported without its C++ parts (docs/deploy.md), so :func:`install` builds, in
``sys.modules`` (restored by ``monkeypatch``; :func:`install_globally` for a fresh worker process), the modules
of one source layout -- ``"1.2"`` (the 1.2.1 image: ``tensorrt_llm/_torch/attention_backend/interface.py``) or
``"main"`` (``tensorrt_llm/_torch/attention/backends/interface.py``). Signatures are the upstream ones recorded
in ``trtllm_signatures.json`` (``test_standins_mirror_the_recorded_signatures``); behaviour is upstream's on
the paths that decide whether serving starts, written from reading upstream (no upstream code). Each upstream
fact they mirror, with the upstream file and the commit read, is one row of docs/deploy.md's table: the frozen
``ModelConfig`` and ``from_config``; ``Attention.__init__`` wiring RoPE and QKV from the configured backend class
(``TrtllmAttention``: both fused, ``VanillaAttention``: neither; ``support_*`` classmethods) and ``Attention.forward``
-> ``apply_rope`` -> ``convert_qkv`` -> the backend (main: ``forward_args=`` by keyword; 1.2: keyword arguments);
``KvCacheCreator``'s estimation (the peak memory measured, ``allocated_bytes`` added back, ``max_gpu_total_bytes``
set), teardown (``shutdown``) and rebuild, and the ``execution_stream`` it hands on; ``TrtllmAttentionMetadata``
and its ``prepare()``; ``AttentionRuntimeFeatures``; ``LlmRequestState``; ``KvCacheConfig``'s defaults (block
reuse on); ``get_pp_layers``' ``layer_mask`` assertion; ``add_dummy_requests`` returning ``None``; the CUDA-graph
padding id; the worker's unpickled ``MODEL_CLASS_MAPPING``.

Simplified on purpose (not on the startup path): the C++ block manager (``impl``) is a Python one (lowest free
block id first, returned on ``remove_sequence``); ``qkv_proj`` / ``o_proj`` are identities (the driver feeds the
packed ``q|k|v`` rows); the model has attention layers only; RoPE is the plain GPT-NeoX rotation.

One module per upstream file group (paths under ``tensorrt_llm/_torch/`` unless named otherwise):

- ``requests.py``: ``pyexecutor/llm_request.py``, ``pyexecutor/scheduler.py``, the padding id of
  ``pyexecutor/cuda_graph_runner.py``;
- ``attention.py``: ``attention_backend/interface.py`` (main: ``attention/backends/interface.py``),
  ``attention_backend/trtllm.py``'s metadata, ``attention_backend/utils.py``'s backend lookup;
- ``resources.py``: ``pyexecutor/resource_manager.py``, with ``KvCacheConfig`` (``tensorrt_llm/llmapi/llm_args.py``)
  and ``Mapping``;
- ``models.py``: ``model_config.py``, ``models/modeling_utils.py``, ``modeling_auto.py``, ``modeling_llama.py``,
  ``modules/attention.py``;
- ``startup.py``: ``KvCacheCreator`` of ``pyexecutor/_util.py``;
- ``layouts.py``: each layout's dotted module names, and the layout installed now;
- ``installation.py``: :func:`install`, :func:`install_globally`, :func:`real_namespace`.

This package re-exports the names the tests use.
"""

from .attention import KVCacheParams
from .installation import install, install_globally, real_namespace
from .models import Attention, ModelConfig, PositionalEmbeddingParams, rope
from .requests import CUDA_GRAPH_DUMMY_REQUEST_ID, ScheduledRequests
from .resources import KvCacheConfig, Mapping
from .startup import torch_bytes

__all__ = [
    "CUDA_GRAPH_DUMMY_REQUEST_ID", "Attention", "KVCacheParams", "KvCacheConfig", "Mapping", "ModelConfig",
    "PositionalEmbeddingParams", "ScheduledRequests", "install", "install_globally", "real_namespace", "rope",
    "torch_bytes",
]
