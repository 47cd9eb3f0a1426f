"""The OSCAR attention backend for TensorRT-LLM (plugins/trtllm/attention.py) on the stand-ins (tests/plugins/
conftest.py): the stock KV-cache manager refused, ``q_scaling`` honoured, prompt chunks told from decode steps."""

from __future__ import annotations

import pytest
import torch

import trtllm_standins
from helpers import (
    TRTLLM_HEADS,
    executor_driver,
    pretrained_config,
    standins_only,
)
from trtllm_driver import Req

pytestmark = pytest.mark.usefixtures("one_thread")


def test_forward_refuses_the_stock_kv_cache_manager(deploy):
    """Bug: metadata.kv_cache_manager is the stock KVCacheManager when the OSCAR cache is not installed."""
    ns, dep = deploy
    d = executor_driver(deploy)
    stock = ns.resource_manager.KVCacheManager(trtllm_standins.KvCacheConfig(max_tokens=1024), "SELF", num_layers=2,
                                               num_kv_heads=2, head_dim=64, tokens_per_block=16, max_seq_len=256,
                                               max_batch_size=2, mapping=trtllm_standins.Mapping())
    md = ns.interface.AttentionMetadata(kv_cache_manager=stock, seq_lens=torch.tensor([1]), num_contexts=0,
                                        request_ids=[1])
    q, kv = torch.zeros(1, TRTLLM_HEADS * 64).bfloat16(), torch.zeros(1, 128).bfloat16()
    with pytest.raises(RuntimeError, match="got a KVCacheManager as the KV cache manager"):
        d.backends[0].forward(q, kv, kv, md)


def test_q_scaling_is_honoured(deploy):
    """Bug: q_scaling was ignored. The kernel's scale is a compile-time constant: a q_scaling that changes it
    is refused at model build time; the prefill attention uses the same scale."""
    ns, dep = deploy
    standins_only(ns)
    with pytest.raises(ValueError, match="q_scaling 2.0 gives softmax scale 0.0625; the kernel bundle was compiled "
                                         "for 0.125"):
        dep.attention_cls(0, TRTLLM_HEADS, 64, 2, None, q_scaling=2.0)
    assert dep.attention_cls(0, TRTLLM_HEADS, 64, 2, None, q_scaling=1.0).scale == 0.125
    pretrained = pretrained_config(dep)
    pretrained.q_scaling = 2.0  # the stand-in model passes it to every Attention
    with pytest.raises(ValueError, match="q_scaling 2.0"):
        ns.modeling_auto.AutoModelForCausalLM.from_config(trtllm_standins.ModelConfig(pretrained_config=pretrained))


def test_chunked_prefill_is_context_by_num_contexts(deploy):
    """Bug: a later prompt chunk (cached tokens > 0) was taken for a decode step (``cached == 0`` test)."""
    d = executor_driver(deploy, chunked_prefill=True)
    reqs = [Req(1, 70, 12, chunk=24), Req(2, 30, 30)]
    d.run_plain(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 50
