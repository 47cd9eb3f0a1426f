"""The KV cache manager (``_torch/pyexecutor/resource_manager.py``) and the configs it is built from
(``KvCacheConfig`` of ``llmapi/llm_args.py``, ``Mapping``)."""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Optional

import torch

from .requests import LlmRequest, LlmRequestState


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
