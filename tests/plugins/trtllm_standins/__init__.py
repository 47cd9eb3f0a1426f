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
"""

from __future__ import annotations

import enum
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
    "cuda_graph_runner": "tensorrt_llm._torch.pyexecutor.cuda_graph_runner",
    "model_config": "tensorrt_llm._torch.model_config",
    "modeling_utils": "tensorrt_llm._torch.models.modeling_utils",
    "modeling_auto": "tensorrt_llm._torch.models.modeling_auto",
    "modeling_llama": "tensorrt_llm._torch.models.modeling_llama",
    "attention_module": "tensorrt_llm._torch.modules.attention",
}

#: ``cuda_graph_runner.py``: the request id of CUDA-graph padding requests
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1


# ---- requests and scheduling (_torch/pyexecutor/llm_request.py, scheduler.py) ------------------------------

class LlmRequestState(enum.Enum):
    """The request states the executor and the adapter use (``llm_request.py`` re-exports the bindings' enum)."""

    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 3
    GENERATION_COMPLETE = 5


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
        self.state = LlmRequestState.CONTEXT_INIT

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
    num_extra_kv_tokens: int = 0


@dataclass
class AttentionRuntimeFeatures:
    """``attention_backend/interface.py`` (51ea5c96): what the executor enabled (``py_executor_creator.py``)."""

    chunked_prefill: bool = False
    cache_reuse: bool = False
    has_speculative_draft_tokens: bool = False


@dataclass(kw_only=True)
class AttentionMetadata:
    max_num_requests: int = 0
    max_num_tokens: int = 0
    kv_cache_manager: Any = None
    seq_lens: Optional[torch.Tensor] = None
    num_contexts: int = 0
    request_ids: Optional[list] = None
    kv_cache_params: Optional[KVCacheParams] = None
    runtime_features: AttentionRuntimeFeatures = field(default_factory=AttentionRuntimeFeatures)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens.sum())


@dataclass(kw_only=True)
class TrtllmAttentionMetadata(AttentionMetadata):
    """``attention_backend/trtllm.py`` (1.x copy the index stores): the metadata the engine builds for the
    configured TRTLLM backend, whose ``prepare()`` runs every step against the KV cache manager it is given."""

    max_num_sequences: Optional[int] = None
    prompt_lens: Optional[list] = None
    beam_width: int = 1

    def prepare(self) -> None:
        """Every request's C++ block offsets into ``[num_pools, max_num_sequences, 2, max_blocks_per_seq]``
        (context rows, then generation rows after them), and each ``kv_len`` within the manager's ``max_seq_len``."""
        kv = self.kv_cache_manager
        n, nc = self.num_seqs, self.num_contexts
        cached = torch.tensor(self.kv_cache_params.num_cached_tokens_per_seq[:n], dtype=torch.int32)
        self.kv_lens = cached + self.seq_lens + self.kv_cache_params.num_extra_kv_tokens
        rows = self.max_num_sequences or self.max_num_requests
        self.host_kv_cache_block_offsets = torch.zeros(kv.num_pools, rows, 2, kv.max_blocks_per_seq,
                                                       dtype=torch.int32)
        kv.impl.copy_batch_block_offsets(self.host_kv_cache_block_offsets, self.request_ids[:nc], 1, 0)
        kv.impl.copy_batch_block_offsets(self.host_kv_cache_block_offsets, self.request_ids[nc:n], self.beam_width,
                                         nc)
        assert int(self.kv_lens.max()) <= kv.max_seq_len, (
            f"The max KV cache length of input sequences ({int(self.kv_lens.max())}) exceeds the KV cache manager's "
            f"maximum supported length ({kv.max_seq_len}).")


TMetadata = TypeVar("TMetadata", bound=AttentionMetadata)


class _Backend12(Generic[TMetadata]):
    """``AttentionBackend(Generic[TMetadata])`` of the 1.2 layout."""

    Metadata = AttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                 quant_config=None, **kwargs) -> None:
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.quant_config = quant_config

    def update_quant_config(self, new_quant_config) -> None:
        self.quant_config = new_quant_config

    def forward(self, q, k, v, metadata, *, attention_mask=None, **kwargs):
        raise NotImplementedError

    @classmethod
    def support_fused_rope(cls) -> bool:
        return False

    @classmethod
    def support_fused_qkv(cls) -> bool:
        return False


class _BackendMain(_Backend12):
    """``AttentionBackend`` of the main layout (``forward_args``)."""

    def forward(self, q, k, v, metadata, forward_args=None, **kwargs):
        raise NotImplementedError


def _fused(base):
    """``TrtllmAttention`` of a layout: RoPE and QKV fused into its kernel."""

    class TrtllmAttention(base):
        Metadata = TrtllmAttentionMetadata

        @classmethod
        def support_fused_rope(cls) -> bool:
            return True

        @classmethod
        def support_fused_qkv(cls) -> bool:
            return True

    return TrtllmAttention


@dataclass(kw_only=True)
class AttentionForwardArgs:
    output: Optional[torch.Tensor] = None
    attention_mask: Any = "causal"


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

    def shutdown(self) -> None:
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

    def copy_batch_block_offsets(self, dst: torch.Tensor, request_ids, beam_width: int, offset: int) -> None:
        """Row ``offset + i`` of ``dst [pools, rows, 2, max_blocks]``: request ``i``'s block ids (K, V)."""
        for i, rid in enumerate(request_ids):
            if rid not in self.seqs:
                raise RuntimeError(f"stand-in C++ block manager: no sequence for request {rid}")
            ids = torch.tensor(self.seqs[rid], dtype=torch.int32)
            dst[0, offset + i, :, : ids.numel()] = ids


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
        self.num_pools = 1
        self.max_attention_window_vec = [max_seq_len]
        if layer_mask is not None:  # get_pp_layers (main): the mask must select num_layers layers
            assert sum(layer_mask) == num_layers, (sum(layer_mask), num_layers)
        # the stream the model forward runs on (upstream: a stream of its own when none is given)
        self._stream = kwargs.get("execution_stream")
        heads = num_kv_heads if isinstance(num_kv_heads, int) else max(num_kv_heads)
        self.stock_pool_bytes = blocks * tokens_per_block * num_layers * heads * head_dim * 2 * 2  # K+V BF16

    @staticmethod
    def get_cache_size_per_token(model_config, mapping, **kwargs) -> int:
        """Bytes of K and V per token over every layer (BF16)."""
        c = model_config.pretrained_config
        return c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * 2

    def get_max_resource_count(self) -> int:
        return self.impl.max_num_blocks

    def get_kv_cache_stats(self):
        """The C++ ``KvCacheStats`` fields the KV-cache estimation reads (its pool's bytes: ``allocated_bytes``)."""
        return types.SimpleNamespace(max_num_blocks=self.impl.max_num_blocks, tokens_per_block=self.tokens_per_block,
                                     allocated_bytes=self.stock_pool_bytes)

    def get_num_free_blocks(self) -> int:
        return len(self.impl.free)

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
        if self.get_num_free_blocks() < 1:  # "No padding if not enough KV cache space"
            return None
        requests = []
        for i, rid in enumerate(request_ids):
            n = token_nums[i] if token_nums is not None else 1 + max_num_draft_tokens
            req = LlmRequest(request_id=rid, max_new_tokens=1, input_tokens=[1] * n)
            req.is_dummy_request = True
            if prepare_resource:
                self.impl.add_sequence(rid, n, 1, req)
            if is_gen:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
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

    def shutdown(self) -> None:
        self.impl = None  # the C++ manager releases its pool


@dataclass
class KvCacheConfig:
    """``llmapi/llm_args.py`` ``KvCacheConfig`` (block reuse on by default, as upstream)."""

    max_tokens: Optional[int] = None
    free_gpu_memory_fraction: Optional[float] = None
    enable_block_reuse: bool = True
    max_gpu_total_bytes: int = 0
    tokens_per_block: int = 32

    def model_copy(self, update=None):
        """pydantic's copy (``llmapi/llm_args.py``: ``KvCacheConfig`` is a pydantic model)."""
        import dataclasses

        return dataclasses.replace(self, **(update or {}))


@dataclass
class Mapping:
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1


# ---- model config and models (_torch/model_config.py, models/, modules/attention.py) -----------------------

@dataclass(kw_only=True)
class ModelConfig:
    pretrained_config: Any = None
    mapping: Mapping = field(default_factory=Mapping)
    quant_config: Any = None
    skip_create_weights_in_init: bool = False
    sparse_attention_config: Any = None
    max_num_tokens: int = 8192
    attn_backend: str = "TRTLLM"
    extra_attrs: dict = field(default_factory=dict, repr=False, init=False)
    _frozen: bool = field(default=False, init=False, repr=False)

    def __setattr__(self, key, value):
        if self._frozen and key not in ("_frozen", "extra_attrs", "pretrained_config", "quant_config"):
            raise AttributeError(f"Cannot modify ModelConfig.'{key}' - instance is frozen")
        super().__setattr__(key, value)


_ACTIVE: dict[str, Any] = {}  # the installed layout's backend classes (install())


def _get_attention_backend(backend_name: str):
    """``get_attention_backend`` of ``attention_backend/utils.py``: a fixed if-chain (TRTLLM the default)."""
    return _ACTIVE["VanillaAttention" if backend_name == "VANILLA" else "TrtllmAttention"]


def _create_attention(backend_name: str, layer_idx, num_heads, head_dim, num_kv_heads=None, **kwargs):
    return _get_attention_backend(backend_name)(layer_idx, num_heads, head_dim, num_kv_heads, **kwargs)


def rope(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """GPT-NeoX RoPE of ``x [tokens, heads * head_dim]`` at ``positions [tokens]`` (float math, ``x``'s dtype)."""
    n = x.shape[0]
    h = x.view(n, -1, head_dim).float()
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.double()[:, None] * inv[None]  # [n, D/2]
    cos, sin = (torch.cat([f(ang), f(ang)], -1).float()[:, None] for f in (torch.cos, torch.sin))
    half = head_dim // 2
    rot = torch.cat([-h[..., half:], h[..., :half]], -1)
    return (h * cos + rot * sin).to(x.dtype).reshape(n, -1)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope_params, head_dim: int, is_neox: bool = True) -> None:
        super().__init__()
        self.theta, self.head_dim = rope_params, head_dim

    def forward(self, position_ids, targets):
        pos = position_ids.reshape(-1)
        return [rope(t, pos, self.head_dim, self.theta) for t in targets]


@dataclass(frozen=True)
class PositionalEmbeddingParams:
    rope: float  # the stand-in keeps only theta
    is_neox: bool = True


class Attention(torch.nn.Module):
    def __init__(self, *, hidden_size: int, num_attention_heads: int, num_key_value_heads: int,
                 max_position_embeddings: int = 2048, bias: bool = False, pos_embd_params=None, rope_fusion=None,
                 layer_idx=None, dtype=None, dense_bias=None, config=None, q_scaling: float = 1.0, **kwargs) -> None:
        super().__init__()
        self.layer_idx, self.q_scaling = layer_idx, q_scaling
        self.num_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.head_dim = getattr(config.pretrained_config, "head_dim", None) or hidden_size // num_attention_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        self.pos_embd_params = pos_embd_params
        self.attn_backend = config.attn_backend
        attn_cls = _get_attention_backend(self.attn_backend)
        self.rope_fusion = rope_fusion
        if self.rope_fusion and not attn_cls.support_fused_rope():
            self.rope_fusion = False
        if self.rope_fusion is None:
            self.rope_fusion = attn_cls.support_fused_rope()
        self.rotary_emb = None
        if not self.rope_fusion and pos_embd_params is not None:
            self.rotary_emb = RotaryEmbedding(pos_embd_params.rope, head_dim=self.head_dim,
                                              is_neox=pos_embd_params.is_neox)
        self.attn = _create_attention(self.attn_backend, layer_idx, self.num_heads, self.head_dim,
                                      self.num_key_value_heads,
                                      pos_embd_params=pos_embd_params if self.rope_fusion else None,
                                      quant_config=config.quant_config, q_scaling=q_scaling)
        self.support_fused_qkv = self.attn.support_fused_qkv()

    def split_qkv(self, q, k=None, v=None):
        if k is None and v is None:
            q, k, v = q.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v

    def convert_qkv(self, q, k, v):
        if k is None and v is None and not self.support_fused_qkv:
            q, k, v = self.split_qkv(q)
        elif k is not None and v is not None and self.support_fused_qkv:
            q, k, v = torch.concat([q, k, v], dim=-1), None, None
        return q, k, v

    def apply_rope(self, q, k, v, position_ids):
        if not self.rope_fusion and position_ids is not None:
            q, k, v = self.split_qkv(q, k, v)
            q, k = self.rotary_emb(position_ids, [q, k])
        return q, k, v

    def forward(self, position_ids, hidden_states, attn_metadata, attention_mask="causal", **kwargs):
        qkv = hidden_states  # qkv_proj: the identity here
        q, k, v = self.apply_rope(qkv, None, None, position_ids)
        q, k, v = self.convert_qkv(q, k, v)
        n = attn_metadata.num_tokens
        q, k, v = q[:n], None if k is None else k[:n], None if v is None else v[:n]
        if _ACTIVE["layout"] == "main":
            fa = _ACTIVE["AttentionForwardArgs"](attention_mask=attention_mask, output=None)
            out = self.attn.forward(q, k, v, attn_metadata, forward_args=fa)
        else:
            out = self.attn.forward(q, k, v, attn_metadata, out_scale=None, out_scale_sf=None,
                                    attention_mask=attention_mask, mrope_config=None, attention_window_size=None,
                                    output=None)
        return out  # o_proj: the identity here


class DecoderModelForCausalLM(torch.nn.Module):
    pass


class LlamaForCausalLM(DecoderModelForCausalLM):
    def __init__(self, model_config) -> None:
        super().__init__()
        self.model_config = model_config
        c = model_config.pretrained_config
        q_scaling = getattr(c, "q_scaling", 1.0)  # stand-in hook for the q_scaling test
        pos = PositionalEmbeddingParams(rope=float(getattr(c, "rope_theta", 10000.0)))
        self.layers = torch.nn.ModuleList(
            Attention(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, pos_embd_params=pos, layer_idx=i, config=model_config,
                      q_scaling=q_scaling)
            for i in range(c.num_hidden_layers)
        )


def _from_config(config):
    """``AutoModelForCausalLM.from_config``: the registered class of ``architectures[0]`` on a frozen config."""
    mapping = sys.modules[COMMON["modeling_utils"]].MODEL_CLASS_MAPPING
    arch = config.pretrained_config.architectures[0]
    if arch not in mapping:
        raise ValueError(f"Unknown architecture for AutoModelForCausalLM: {arch}")
    cls = mapping[arch]
    if issubclass(cls, DecoderModelForCausalLM):
        config._frozen = False
        config.skip_create_weights_in_init = True
        config._frozen = True
    return cls(config)


# ---- startup: KvCacheCreator (_torch/pyexecutor/_util.py) ---------------------------------------------------

def torch_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process: the stand-in's ``torch.cuda.memory_stats``."""
    import gc

    gc.collect()  # garbage (earlier tests' tensors in cycles) is not memory in use
    sizes = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type != "meta":
            try:
                st = o.untyped_storage()
                sizes[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):  # a fake / functional tensor (a compile's) holds no memory
                continue
    return sum(sizes.values())


class KvCacheCreator:
    """The estimation, teardown and rebuild of the KV cache manager that ``create_py_executor`` runs, written from
    ``_util.py``: the 1.x copy the index stores (``_create_kv_cache_manager(self, model_engine,
    estimating_kv_cache)`` passes no ``is_estimating_kv_cache`` to the manager; ``configure_kv_cache_capacity``
    measures the peak memory, adds ``get_kv_cache_stats().allocated_bytes`` back, takes ``fraction`` (0.9 when
    unset) of it, sets ``max_tokens`` and ``max_gpu_total_bytes``) and main (d8ae02ca: passes
    ``is_estimating_kv_cache``). ``execution_stream``: ``create_py_executor`` hands it to ``KvCacheCreator``
    (``py_executor_creator.py`` @000429d5) and main's ``_create_kv_cache_manager`` passes it to the manager;
    that 1.2.1's does is not verified (the 1.x copy read predates it), so the stream tests run with and without it.
    """

    def __init__(self, *, model, mapping, max_num_tokens: int, tokens_per_block: int, max_seq_len: int,
                 max_batch_size: int, kv_cache_config, execution_stream=None) -> None:
        self._model, self._mapping, self._kv_cache_config = model, mapping, kv_cache_config
        self._execution_stream = execution_stream  # py_executor_creator.py @000429d5 creates it, passes it here
        self._max_kv_tokens_in = kv_cache_config.max_tokens
        self._max_num_tokens, self._tokens_per_block = max_num_tokens, tokens_per_block
        self._max_seq_len, self._max_batch_size = max_seq_len, max_batch_size
        util = sys.modules[COMMON["util"]]  # the module global, looked up now (a patch must precede this)
        mc = model.model_config
        self._kv_cache_manager_cls = (util.get_kv_cache_manager_cls(mc) if _ACTIVE["layout"] == "1.2"
                                      else util.get_kv_cache_manager_cls(mc, kv_cache_config))
        self.dummy_requests = self._create_dummy_context_requests(max(1, max_seq_len - 1))

    def _create_dummy_context_requests(self, input_seq_len: int) -> list[int]:
        """Prompt lengths of the estimation requests (each ``max_tokens=1``)."""
        out, remaining = [], self._max_num_tokens
        n = min(self._max_num_tokens, input_seq_len)
        while remaining > 0:
            n = min(n, remaining)
            out.append(n)
            remaining -= n
        return out

    def try_prepare_estimation(self) -> bool:
        extra = 1 + 1  # one generated token, and one more with the overlap scheduler
        blocks = sum(math.ceil((n + extra) / self._tokens_per_block) for n in self.dummy_requests)
        self._kv_cache_config.max_tokens = blocks * self._tokens_per_block
        return self._model.model_config.attn_backend != "VANILLA"

    def configure_kv_cache_capacity(self, py_executor) -> None:
        """Run the dummy requests, measure the peak memory (here: bytes of live tensors, plus the stand-in C++
        pool, which upstream's C++ allocates outside torch), add the KV manager's ``allocated_bytes`` back, and set
        ``max_tokens`` and ``max_gpu_total_bytes`` from ``fraction`` of what is left."""
        fraction = self._kv_cache_config.free_gpu_memory_fraction or 0.9
        py_executor.run_dummy_requests()
        mgr = py_executor.kv_cache_manager
        peak_memory = torch_bytes() + mgr.stock_pool_bytes
        allocated_bytes = mgr.get_kv_cache_stats().allocated_bytes
        kv_max = int((py_executor.total_gpu_memory - peak_memory + allocated_bytes) * fraction)
        per_token = self._kv_cache_manager_cls.get_cache_size_per_token(
            self._model.model_config, self._mapping, tokens_per_block=self._tokens_per_block)
        if self._max_kv_tokens_in is not None:
            kv_max = min(kv_max, self._max_kv_tokens_in * per_token)
        self._kv_cache_config.max_tokens = int(kv_max // per_token)
        if self._kv_cache_config.max_gpu_total_bytes > 0:
            kv_max = min(kv_max, self._kv_cache_config.max_gpu_total_bytes)
        self._kv_cache_config.max_gpu_total_bytes = kv_max

    def build_managers(self, resources: dict, estimating_kv_cache: bool = False) -> None:
        c = self._model.model_config.pretrained_config
        resources["kv_cache_manager"] = self._kv_cache_manager_cls(
            self._kv_cache_config, "SELF", num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, tokens_per_block=self._tokens_per_block, max_seq_len=self._max_seq_len,
            max_batch_size=self._max_batch_size, mapping=self._mapping, max_num_tokens=self._max_num_tokens,
            execution_stream=self._execution_stream,
            # main's _create_kv_cache_manager passes the flag; the 1.x copy read does not
            **({} if _ACTIVE["layout"] == "1.2" else {"is_estimating_kv_cache": estimating_kv_cache}))

    def teardown_managers(self, resources: dict) -> None:
        resources["kv_cache_manager"].shutdown()
        del resources["kv_cache_manager"]


# ---- installation ---------------------------------------------------------------------------------------------

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
    iface.AttentionBackend = backend = _Backend12 if layout == "1.2" else _BackendMain
    _ACTIVE.clear()
    _ACTIVE["layout"] = layout
    _ACTIVE["TrtllmAttention"] = _fused(backend)
    _ACTIVE["VanillaAttention"] = type("VanillaAttention", (backend,), {})
    for name in ("TrtllmAttention", "VanillaAttention"):
        setattr(ns, name, _ACTIVE[name])
    iface.AttentionMetadata, iface.KVCacheParams = AttentionMetadata, KVCacheParams
    iface.AttentionRuntimeFeatures = AttentionRuntimeFeatures
    if layout == "main":
        iface.AttentionForwardArgs = _ACTIVE["AttentionForwardArgs"] = AttentionForwardArgs
    utils = module(names["utils"])
    utils.create_attention, utils.get_attention_backend = _create_attention, _get_attention_backend
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
    auto.AutoModelForCausalLM = types.SimpleNamespace(from_config=_from_config)
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
