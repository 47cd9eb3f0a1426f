"""The installation of one layout's stand-ins into ``sys.modules`` under TensorRT-LLM's module names, and the real
package's modules by the same short names."""

from __future__ import annotations

import sys
import types

from .attention import (
    AttentionBackend12,
    AttentionBackendMain,
    AttentionForwardArgs,
    AttentionMetadata,
    AttentionRuntimeFeatures,
    KVCacheParams,
    create_attention,
    fused_backend,
    get_attention_backend,
)
from .layouts import ACTIVE, COMMON, MODULES
from .models import Attention, DecoderModelForCausalLM, LlamaForCausalLM, ModelConfig, from_config
from .requests import CUDA_GRAPH_DUMMY_REQUEST_ID, LlmRequest, LlmRequestState, ScheduledRequests
from .resources import BaseResourceManager, KVCacheManager
from .startup import KvCacheCreator


def install(monkeypatch, layout: str) -> types.SimpleNamespace:
    """Put the stand-in modules of ``layout`` into ``sys.modules``; returns them by short name.

    ``monkeypatch=None``: for good (a fresh worker process)."""
    names = {**MODULES[layout], **COMMON}
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        if monkeypatch is None:
            del sys.modules[name]
        else:
            monkeypatch.delitem(sys.modules, name)
    made: dict[str, types.ModuleType] = {}

    def module(dotted: str) -> types.ModuleType:
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in made:
                m = types.ModuleType(name)
                m.__path__ = []  # a package, so submodules import
                made[name] = m
                if monkeypatch is None:
                    sys.modules[name] = m
                else:
                    monkeypatch.setitem(sys.modules, name, m)
                if i > 1:
                    setattr(made[".".join(parts[: i - 1])], parts[i - 1], m)
        return made[dotted]

    ns = types.SimpleNamespace(layout=layout)
    iface = module(names["interface"])
    iface.AttentionBackend = backend = AttentionBackend12 if layout == "1.2" else AttentionBackendMain
    ACTIVE.clear()
    ACTIVE["layout"] = layout
    ACTIVE["TrtllmAttention"] = fused_backend(backend)
    ACTIVE["VanillaAttention"] = type("VanillaAttention", (backend,), {})
    for name in ("TrtllmAttention", "VanillaAttention"):
        setattr(ns, name, ACTIVE[name])
    iface.AttentionMetadata, iface.KVCacheParams = AttentionMetadata, KVCacheParams
    iface.AttentionRuntimeFeatures = AttentionRuntimeFeatures
    if layout == "main":
        iface.AttentionForwardArgs = ACTIVE["AttentionForwardArgs"] = AttentionForwardArgs
    utils = module(names["utils"])
    utils.create_attention, utils.get_attention_backend = create_attention, get_attention_backend
    rm = module(names["resource_manager"])
    rm.BaseResourceManager, rm.KVCacheManager = BaseResourceManager, KVCacheManager
    util = module(names["util"])
    if layout == "1.2":
        def get_kv_cache_manager_cls(model_config):
            return KVCacheManager
    else:
        def get_kv_cache_manager_cls(model_config, kv_cache_config, is_disagg=False, cache_transceiver_config=None):
            return KVCacheManager
    util.get_kv_cache_manager_cls = get_kv_cache_manager_cls
    util.KvCacheCreator = KvCacheCreator
    module(names["scheduler"]).ScheduledRequests = ScheduledRequests
    module(names["llm_request"]).LlmRequest = LlmRequest
    module(names["llm_request"]).LlmRequestState = LlmRequestState
    module(names["cuda_graph_runner"]).CUDA_GRAPH_DUMMY_REQUEST_ID = CUDA_GRAPH_DUMMY_REQUEST_ID
    module(names["model_config"]).ModelConfig = ModelConfig
    mu = module(names["modeling_utils"])
    mu.MODEL_CLASS_MAPPING = {}
    mu.DecoderModelForCausalLM = DecoderModelForCausalLM

    def register_auto_model(name: str):
        def decorator(cls):
            mu.MODEL_CLASS_MAPPING[name] = cls
            return cls
        return decorator

    mu.register_auto_model = register_auto_model
    auto = module(names["modeling_auto"])
    auto.MODEL_CLASS_MAPPING = mu.MODEL_CLASS_MAPPING  # re-exported: executor/proxy.py imports it from here
    auto.AutoModelForCausalLM = types.SimpleNamespace(from_config=from_config)
    module(names["modeling_llama"]).LlamaForCausalLM = LlamaForCausalLM
    module(names["attention_module"]).Attention = Attention
    for short, dotted in names.items():
        setattr(ns, short, made[dotted])
    return ns


def install_globally(layout: str) -> types.SimpleNamespace:
    """:func:`install` for the lifetime of this process (a worker started for one test)."""
    return install(None, layout)


def real_namespace() -> types.SimpleNamespace:
    """The installed TensorRT-LLM's modules by the same short names (only where it imports)."""
    import importlib

    from oscar_export.plugins.trtllm.upstream import resolve

    layout = resolve().layout
    names = {**MODULES[layout], **COMMON}
    return types.SimpleNamespace(layout=layout, real=True,
                                 **{k: importlib.import_module(v) for k, v in names.items() if k in (
                                     "interface", "resource_manager", "util", "modeling_utils")})
