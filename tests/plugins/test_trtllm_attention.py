"""The OSCAR attention backend for TensorRT-LLM (plugins/trtllm/attention.py) on the stand-ins (tests/plugins/
conftest.py): the stock KV-cache manager refused, ``q_scaling`` honoured, prompt chunks told from decode steps."""

from __future__ import annotations

import pytest
import torch

import trtllm_standins
from helpers import (
    TRTLLM_HEADS,
    TRTLLM_LAYERS,
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


def test_the_decode_step_serves_only_the_scheduled_slots(deploy, monkeypatch):
    """With 3 sequence slots (and the scratch slot) and one request decoding, the decode kernels run over one row,
    not over every slot (before: every step wrote and attended all 4 rows, idle slots' pages included); the cache
    and outputs still equal the reference's."""
    from oscar_export.plugins.trtllm.reference_ops import TorchCacheOps

    seen = []
    decode_step, decode = TorchCacheOps.decode_step, TorchCacheOps.decode

    def counting_step(self, state, k, v, status, transform, q):
        seen.append(("decode_step", k.shape[0], state.sink_k.shape[0]))
        return decode_step(self, state, k, v, status, transform, q)

    def counting_decode(self, q_s, state, transform, pages_per_split=8):
        seen.append(("decode", q_s.shape[0], state.sink_k.shape[0]))
        return decode(self, q_s, state, transform, pages_per_split)

    monkeypatch.setattr(TorchCacheOps, "decode_step", counting_step)
    monkeypatch.setattr(TorchCacheOps, "decode", counting_decode)
    d = executor_driver(deploy, max_batch=3)
    reqs = [Req(1, 20, 24)]
    d.run_plain(reqs)
    assert reqs[0].done and d.checked_outputs > 40
    assert seen and {rows for _, rows, _ in seen} == {1} and {state_rows for *_, state_rows in seen} == {1}, seen[:4]


def test_a_batch_of_prompts_is_attended_and_written_in_few_calls(deploy, monkeypatch):
    """Four prompts in one forward (lengths 100, 60, 12, 10): each layer attends them in two calls (the two length
    groups of plugins/trtllm/prefill.py) and quantizes their pages in one (before: one attention call per prompt and
    one page write per prompt with pages, per layer); outputs and cache equal the reference's."""
    import oscar_export.kernels.reference.writers as writers

    calls = {"attention": 0, "pages": 0}
    sdpa, write_pages = torch.nn.functional.scaled_dot_product_attention, writers.write_pages

    def counting_sdpa(*args, **kwargs):
        calls["attention"] += 1
        return sdpa(*args, **kwargs)

    def counting_pages(state, *args, **kwargs):
        calls["pages"] += any(state.k_codes is st.k_codes for st in d.mgr.layers)  # not the driver's reference
        return write_pages(state, *args, **kwargs)

    d = executor_driver(deploy, max_batch=4)
    reqs = [Req(1, 100, 10), Req(2, 10, 20), Req(3, 12, 20), Req(4, 60, 30)]
    ctx, gen = d.schedule(reqs)
    assert [r.rid for r in ctx] == [1, 2, 3, 4] and not gen
    d.prepare(d.batch(ctx, gen), ctx, gen)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(writers, "write_pages", counting_pages)
    d.forward(ctx, gen, check=False)  # the driver's own check calls attention too
    assert calls == {"attention": 2 * TRTLLM_LAYERS, "pages": TRTLLM_LAYERS}, calls
    monkeypatch.undo()
    d.check_cache(reqs)
    d.run_plain(reqs)  # the rest of the requests, every output checked
    assert all(r.done for r in reqs) and d.checked_outputs > 150
