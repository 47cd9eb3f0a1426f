"""Stand-ins for the TensorRT-LLM classes the OSCAR adapter touches, placed under their real dotted module names.

TensorRT-LLM cannot be imported without its C++ parts (../shared/TRTLLM.md), so :func:`install` builds, in
``sys.modules`` (restored by ``monkeypatch``), the modules of one source layout -- ``"1.2"`` (the 1.2.1
image: ``tensorrt_llm/_torch/attention_backend/interface.py``) or ``"main"`` (``tensorrt_llm/_torch/attention/
backends/interface.py``) -- with classes whose signatures are the upstream ones recorded in
``trtllm_signatures.json`` (checked by ``test_standins_mirror_the_recorded_signatures``) and whose behaviour is
the upstream behaviour the adapter relies on, written from reading upstream (no upstream code):

* ``KVCacheManager``: a Python block manager in place of the C++ one (``impl``): ``add_sequence`` allocates
  ``ceil(prompt_len / tokens_per_block)`` blocks lowest id first, ``add_token`` one more when the last is full,
  ``remove_sequence`` returns them (so a later request reuses a finished one's blocks); ``prepare_resources`` /
  ``add_dummy_requests`` / ``free_resources`` / ``get_cache_indices`` as upstream's Python wrapper does;
* ``get_kv_cache_manager_cls`` (``_torch/pyexecutor/_util.py``): the fixed dispatch returning ``KVCacheManager``;
* ``register_auto_model`` / ``MODEL_CLASS_MAPPING`` (``_torch/models/modeling_utils.py``);
* ``LlamaForCausalLM`` with one ``Attention`` module per layer (``_torch/modules/attention.py``) whose ``attn``
  comes from ``create_attention(model_config.attn_backend, ...)``: TRTLLM -> ``TrtllmAttention``, VANILLA ->
  ``VanillaAttention`` (only the class identity and constructor matter here);
* ``ScheduledRequests``, ``LlmRequest``, ``AttentionMetadata`` with the fields of TRTLLM.md fact 8.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Generic, Optional, TypeVar

import torch

MODULES = {
    "1.2": {"interface": "tensorrt_llm._torch.attention_backend.interface",
            "utils": "tensorrt_llm._torch.attention_backend.utils"},
    "main": {"interface": "tensorrt_llm._torch.attention.backends.interface",
             "utils": "tensorrt_llm._torch.attention.backends.utils"},
}
COMMON = {
    "resource_manager": "tensorrt_llm._torch.pyexecutor.resource_manager",
    "util": "tensorrt_llm._torch.pyexecutor._util",
    "scheduler": "tensorrt_llm._torch.pyexecutor.scheduler",
    "llm_request": "tensorrt_llm._torch.pyexecutor.llm_request",
    "modeling_utils": "tensorrt_llm._torch.models.modeling_utils",
    "modeling_llama": "tensorrt_llm._torch.models.modeling_llama",
    "attention_module": "tensorrt_llm._torch.modules.attention",
}


# ---- requests and scheduling (_torch/pyexecutor/llm_request.py, scheduler.py) ------------------------------

class LlmRequest:
    def __init__(self, request_id: int, max_new_tokens: int, input_tokens: list[int], sampling_config=None,
                 is_streaming: bool = False, **kwargs) -> None:
        self.py_request_id = request_id
        self.max_new_tokens = max_new_tokens
        self.prompt_len = len(input_tokens)
        self.py_prompt_len = self.prompt_len
        self.orig_prompt_len = self.prompt_len
        self.context_chunk_size = self.prompt_len
        self.context_current_position = 0
        self.is_dummy_request = False
        self.state = "CONTEXT_INIT"

    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == 0

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= self.prompt_len


@dataclass
class ScheduledRequests:
    context_requests: list = field(default_factory=list)
    generation_requests: list = field(default_factory=list)

    def all_requests(self) -> list:
        return list(self.context_requests) + list(self.generation_requests)


# ---- attention interface ----------------------------------------------------------------------------------

@dataclass
class KVCacheParams:
    use_cache: bool = True
    num_cached_tokens_per_seq: list = field(default_factory=list)


@dataclass(kw_only=True)
class AttentionMetadata:
    max_num_requests: int = 0
    max_num_tokens: int = 0
    kv_cache_manager: Any = None
    seq_lens: Optional[torch.Tensor] = None
    num_contexts: int = 0
    request_ids: Optional[list] = None
    kv_cache_params: Optional[KVCacheParams] = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


TMetadata = TypeVar("TMetadata", bound=AttentionMetadata)


class _Backend12(Generic[TMetadata]):
    """``AttentionBackend(Generic[TMetadata])`` of the 1.2 layout."""

    Metadata = AttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                 quant_config=None, **kwargs) -> None:
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.quant_config = quant_config

    def forward(self, q, k, v, metadata, *, attention_mask=None, **kwargs):
        raise NotImplementedError

    def support_fused_rope(self) -> bool:
        return False

    def support_fused_qkv(self) -> bool:
        return False


class _BackendMain(_Backend12):
    """``AttentionBackend`` of the main layout (``forward_args`` with a preallocated output)."""

    def forward(self, q, k, v, metadata, forward_args=None, **kwargs):
        raise NotImplementedError


@dataclass
class AttentionForwardArgs:
    output: Optional[torch.Tensor] = None
    attention_mask: Any = None


# ---- the KV cache manager (_torch/pyexecutor/resource_manager.py) -----------------------------------------

class BaseResourceManager:
    def get_max_resource_count(self) -> int:
        raise NotImplementedError

    def get_needed_resource_to_completion(self, request) -> int:
        raise NotImplementedError

    def prepare_resources(self, scheduled_batch) -> None:
        pass

    def update_resources(self, scheduled_batch, *args, **kwargs) -> None:
        pass

    def free_resources(self, request) -> None:
        pass


class _BlockManager:
    """Stands in for the C++ ``KVCacheManager`` (``impl``): blocks of ``tokens_per_block`` tokens, lowest free id
    first, returned on ``remove_sequence``."""

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        self.max_num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.free = list(range(num_blocks))
        self.seqs: dict[int, list[int]] = {}
        self.tokens: dict[int, int] = {}

    def _grow(self, rid: int) -> None:
        while len(self.seqs[rid]) * self.tokens_per_block < self.tokens[rid]:
            if not self.free:
                raise RuntimeError("stand-in C++ block manager: out of blocks")
            self.free.sort()
            self.seqs[rid].append(self.free.pop(0))

    def add_sequence(self, rid: int, tokens: int, beam_width: int = 1, req=None) -> None:
        assert rid not in self.seqs, rid
        self.seqs[rid], self.tokens[rid] = [], tokens
        self._grow(rid)

    def add_token(self, rid: int) -> None:
        self.tokens[rid] += 1
        self._grow(rid)

    def remove_sequence(self, rid: int, req=None, pin_on_release: bool = False) -> None:
        self.free += self.seqs.pop(rid)
        del self.tokens[rid]

    def get_cache_block_ids(self, rid: int, window_size: int) -> list[list[int]]:
        return [list(self.seqs[rid])]


class KVCacheManager(BaseResourceManager):
    def __init__(self, kv_cache_config, kv_cache_type, *, num_layers: int, num_kv_heads, head_dim: int,
                 tokens_per_block: int, max_seq_len: int, max_batch_size: int, mapping, dtype=None, spec_config=None,
                 layer_mask=None, max_num_tokens: int = 8192, model_config=None, max_beam_width: int = 1,
                 is_draft: bool = False, kv_connector_manager=None, **kwargs) -> None:
        self.tokens_per_block, self.num_layers, self.head_dim = tokens_per_block, num_layers, head_dim
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        max_tokens = kv_cache_config.max_tokens if kv_cache_config.max_tokens is not None else 1 << 20
        blocks = math.ceil(max_tokens / tokens_per_block)  # calculate_max_num_blocks with max_tokens set
        self.impl = _BlockManager(blocks, tokens_per_block)
        self.max_blocks_per_seq = math.ceil(max_seq_len / tokens_per_block)
        self.max_attention_window_vec = [max_seq_len]
        heads = num_kv_heads if isinstance(num_kv_heads, int) else max(num_kv_heads)
        self.stock_pool_bytes = blocks * tokens_per_block * num_layers * heads * head_dim * 2 * 2  # K+V BF16

    def get_max_resource_count(self) -> int:
        return self.impl.max_num_blocks

    def get_needed_resource_to_completion(self, request) -> int:
        return math.ceil((request.orig_prompt_len + request.max_new_tokens) / self.tokens_per_block)

    def prepare_resources(self, scheduled_batch) -> None:
        for req in scheduled_batch.context_requests:
            if req.is_first_context_chunk:
                self.impl.add_sequence(req.py_request_id, req.prompt_len, 1, req)
        for req in scheduled_batch.generation_requests:
            self.impl.add_token(req.py_request_id)

    def add_dummy_requests(self, request_ids, token_nums=None, is_gen: bool = False, prepare_resource: bool = True,
                           max_num_draft_tokens: int = 0, use_mrope: bool = False, max_beam_width: int = 1,
                           num_extra_decoding_steps: int = 0):
        requests = []
        for i, rid in enumerate(request_ids):
            n = token_nums[i] if token_nums is not None else 1 + max_num_draft_tokens
            req = LlmRequest(request_id=rid, max_new_tokens=1, input_tokens=[1] * n)
            req.is_dummy_request = True
            if prepare_resource:
                self.impl.add_sequence(rid, n, 1, req)
            if is_gen:
                req.state = "GENERATION_IN_PROGRESS"
                req.prompt_len = n - 1
                req.py_prompt_len = req.prompt_len
            requests.append(req)
        return requests

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        pass  # upstream: draft-token relocation, rewind, store_context_blocks (block reuse: off here)

    def free_resources(self, request, pin_on_release: bool = False):
        return self.impl.remove_sequence(request.py_request_id, request, pin_on_release)

    def get_cache_indices(self, request, window_size: Optional[int] = None) -> list[int]:
        return self.impl.get_cache_block_ids(request.py_request_id, window_size or self.max_seq_len)[0]


@dataclass
class KvCacheConfig:
    max_tokens: Optional[int] = None
    free_gpu_memory_fraction: Optional[float] = None
    enable_block_reuse: bool = False
    tokens_per_block: int = 32


@dataclass
class Mapping:
    world_size: int = 1
    tp_size: int = 1


# ---- models (_torch/models/modeling_utils.py, modeling_llama.py, _torch/modules/attention.py) ------------

_ACTIVE: dict[str, Any] = {}  # the installed layout's backend classes (install())


def _create_attention(backend_name: str, layer_idx, num_heads, head_dim, num_kv_heads=None, **kwargs):
    """``create_attention`` of ``attention_backend/utils.py``: the backend class by name."""
    cls = _ACTIVE["VanillaAttention" if backend_name == "VANILLA" else "TrtllmAttention"]
    return cls(layer_idx, num_heads, head_dim, num_kv_heads, **kwargs)


class Attention(torch.nn.Module):
    def __init__(self, *, hidden_size: int, num_attention_heads: int, num_key_value_heads: int, layer_idx: int,
                 config=None, q_scaling: float = 1.0, **kwargs) -> None:
        super().__init__()
        self.layer_idx, self.q_scaling = layer_idx, q_scaling
        self.num_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.attn = _create_attention(config.attn_backend, layer_idx, num_attention_heads, self.head_dim,
                                      num_key_value_heads, q_scaling=q_scaling)


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, model_config) -> None:
        super().__init__()
        c = model_config.pretrained_config
        q_scaling = getattr(model_config, "q_scaling", 1.0)
        self.layers = torch.nn.ModuleList(
            Attention(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, layer_idx=i, config=model_config, q_scaling=q_scaling)
            for i in range(c.num_hidden_layers)
        )


@dataclass
class ModelConfig:
    pretrained_config: Any
    attn_backend: str = "TRTLLM"
    q_scaling: float = 1.0
    sparse_attention_config: Any = None


def install(monkeypatch, layout: str) -> types.SimpleNamespace:
    """Put the stand-in modules of ``layout`` into ``sys.modules``; returns them by short name."""
    names = {**MODULES[layout], **COMMON}
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
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
                monkeypatch.setitem(sys.modules, name, m)
                if i > 1:
                    setattr(made[".".join(parts[: i - 1])], parts[i - 1], m)
        return made[dotted]

    ns = types.SimpleNamespace(layout=layout)
    iface = module(names["interface"])
    iface.AttentionBackend = backend = _Backend12 if layout == "1.2" else _BackendMain
    for name in ("TrtllmAttention", "VanillaAttention"):
        _ACTIVE[name] = type(name, (backend,), {})
        setattr(ns, name, _ACTIVE[name])
    iface.AttentionMetadata, iface.KVCacheParams = AttentionMetadata, KVCacheParams
    if layout == "main":
        iface.AttentionForwardArgs = AttentionForwardArgs
    module(names["utils"]).create_attention = _create_attention
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
    module(names["scheduler"]).ScheduledRequests = ScheduledRequests
    module(names["llm_request"]).LlmRequest = LlmRequest
    mu = module(names["modeling_utils"])
    mu.MODEL_CLASS_MAPPING = {}

    def register_auto_model(name: str):
        def decorator(cls):
            mu.MODEL_CLASS_MAPPING[name] = cls
            return cls
        return decorator

    mu.register_auto_model = register_auto_model
    module(names["modeling_llama"]).LlamaForCausalLM = LlamaForCausalLM
    module(names["attention_module"]).Attention = Attention
    for short, dotted in names.items():
        setattr(ns, short, made[dotted])
    return ns


def real_namespace() -> types.SimpleNamespace:
    """The installed TensorRT-LLM's modules by the same short names (only where it imports)."""
    import importlib

    from oscar_export.plugins.trtllm.upstream import resolve

    layout = resolve().layout
    names = {**MODULES[layout], **COMMON}
    return types.SimpleNamespace(layout=layout, real=True,
                                 **{k: importlib.import_module(v) for k, v in names.items() if k in (
                                     "interface", "resource_manager", "util", "modeling_utils")})
