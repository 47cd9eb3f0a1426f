"""The attention interface: ``attention_backend/interface.py`` (1.2; main: ``attention/backends/interface.py``),
the TRTLLM backend's metadata (``attention_backend/trtllm.py``) and the backend lookup
(``attention_backend/utils.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Optional, TypeVar

import torch

from .layouts import ACTIVE


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


class AttentionBackend12(Generic[TMetadata]):
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


class AttentionBackendMain(AttentionBackend12):
    """``AttentionBackend`` of the main layout (``forward_args``)."""

    def forward(self, q, k, v, metadata, forward_args=None, **kwargs):
        raise NotImplementedError


def fused_backend(base):
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


def get_attention_backend(backend_name: str):
    """``get_attention_backend`` of ``attention_backend/utils.py``: a fixed if-chain (TRTLLM the default)."""
    return ACTIVE["VanillaAttention" if backend_name == "VANILLA" else "TrtllmAttention"]


def create_attention(backend_name: str, layer_idx, num_heads, head_dim, num_kv_heads=None, **kwargs):
    return get_attention_backend(backend_name)(layer_idx, num_heads, head_dim, num_kv_heads, **kwargs)
