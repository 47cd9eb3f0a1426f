"""Model config and models: ``_torch/model_config.py``, ``models/`` (``modeling_utils.py``, ``modeling_auto.py``,
``modeling_llama.py``) and ``modules/attention.py``."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .attention import create_attention, get_attention_backend
from .layouts import ACTIVE, COMMON
from .resources import Mapping


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
        attn_cls = get_attention_backend(self.attn_backend)
        self.rope_fusion = rope_fusion
        if self.rope_fusion and not attn_cls.support_fused_rope():
            self.rope_fusion = False
        if self.rope_fusion is None:
            self.rope_fusion = attn_cls.support_fused_rope()
        self.rotary_emb = None
        if not self.rope_fusion and pos_embd_params is not None:
            self.rotary_emb = RotaryEmbedding(pos_embd_params.rope, head_dim=self.head_dim,
                                              is_neox=pos_embd_params.is_neox)
        self.attn = create_attention(self.attn_backend, layer_idx, self.num_heads, self.head_dim,
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
        if ACTIVE["layout"] == "main":
            fa = ACTIVE["AttentionForwardArgs"](attention_mask=attention_mask, output=None)
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


def from_config(config):
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
