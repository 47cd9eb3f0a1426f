"""The OSCAR KV-cache manager for TensorRT-LLM (plugins/trtllm/cache.py) on the stand-ins (tests/plugins/conftest.py):
the KV-cache estimation and rebuild, the budget and slot limits, padding (dummy) requests, and executor-loop replays
(tests/plugins/trtllm_driver.py: plain loop, overlap loop, CUDA-graph warmup/capture/replay, per-layer key widths)
whose cache after every step equals the reference cache writer's; a non-finite token fails its request only."""

from __future__ import annotations

import functools

import pytest

import trtllm_standins
from helpers import (
    TRTLLM_LAYERS,
    TRTLLM_LAYOUT,
    TRTLLM_MAX_SEQ,
    executor_driver,
    standins_only,
    window_requests,
)
from trtllm_driver import Req

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- startup on upstream's construction and estimation paths -----------------------------------------------


def test_kv_cache_estimation_builds_twice_frees_the_first_and_serves(deploy):
    """Upstream builds the KV manager for the estimation, runs dummy context requests of max_num_tokens, sizes the
    cache from get_cache_size_per_token, shuts the manager down and builds it again. The OSCAR pools of the first
    build are released by shutdown (the engine may still hold that manager), the budget is counted in OSCAR
    bytes per token, and the rebuilt manager serves."""
    import gc
    import weakref

    ns, dep = deploy
    d = executor_driver(deploy, estimate=True)
    assert d.estimated and d.creator.dummy_requests == [TRTLLM_MAX_SEQ - 1, 1]
    old = d.estimation_mgr
    assert old is not None and old is not d.mgr and type(d.mgr) is dep.manager_cls
    gc.collect()
    assert old.book is None and not old.layers and not old.step_layers  # the pools went with shutdown()
    pools = [weakref.ref(getattr(s, f)) for s in d.mgr.layers for f in ("k_codes", "v_codes")]
    per_page = sum(getattr(s, f)[0].numel() * getattr(s, f).element_size() for s in d.mgr.layers
                   for f in ("k_codes", "k_params", "v_codes", "v_params"))
    per_token = dep.manager_cls.get_cache_size_per_token(d.model_config, trtllm_standins.Mapping())
    lay = TRTLLM_LAYOUT
    assert per_token == -(-per_page // lay.page_size) + 2 * 2 * lay.num_kv_heads * lay.head_dim
    assert per_token < ns.resource_manager.KVCacheManager.get_cache_size_per_token(d.model_config, None)
    budget = d.kv_config.max_gpu_total_bytes  # upstream's: 0.9 of the memory left besides the KV cache
    assert 0.9 * (1 << 34) - (1 << 22) <= budget <= 0.9 * (1 << 34), budget
    assert d.kv_config.max_tokens == budget // per_token  # the budget, in OSCAR tokens
    assert d.mgr.layers[0].k_codes.shape[0] == d.mgr.get_max_resource_count()
    reqs = window_requests()[:3]
    d.run_plain(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 100
    d.mgr.shutdown()
    gc.collect()
    assert all(r() is None for r in pools)


def test_kv_cache_budget_below_the_slots_fails_at_startup(deploy):
    """The memory left after the estimation must hold max_batch_size sequences of max_seq_len: else one clear
    error at the rebuild (not an out-of-memory later), in both layouts -- 1.x does not pass
    is_estimating_kv_cache, so the refusal reads the max_gpu_total_bytes the estimation sets (before: on the 1.2
    stand-in only because it passed the flag, which 1.2.1 does not)."""
    ns, dep = deploy
    per_token = dep.manager_cls.get_cache_size_per_token()
    with pytest.raises(ValueError, match=rf"^max_batch_size 3 x max_seq_len 128 needs 384 tokens of OSCAR cache "
                                         rf"\({384 * per_token} bytes\); the KV cache memory holds \d+ bytes") as e:
        executor_driver(deploy, estimate=True, available_bytes=100 * per_token)
    assert "\n" not in str(e.value)
    # the estimation's own build: its max_tokens is the dummy requests' tokens, no budget
    kw = dict(num_layers=TRTLLM_LAYERS, num_kv_heads=2, head_dim=64, tokens_per_block=16, max_seq_len=TRTLLM_MAX_SEQ,
              max_batch_size=3, mapping=trtllm_standins.Mapping())
    mgr = dep.manager_cls(trtllm_standins.KvCacheConfig(max_tokens=100, enable_block_reuse=False), "SELF", **kw)
    assert mgr.get_max_resource_count() == 3 * TRTLLM_MAX_SEQ // 16


def test_the_estimation_counts_the_oscar_pools_as_kv_cache(deploy):
    """Upstream's estimation (configure_kv_cache_capacity) measures the peak memory and adds back only the KV
    manager's get_kv_cache_stats().allocated_bytes. The OSCAR pools, windows and page book are KV cache too: left
    out, they count as activations and the budget shrinks by their size -- here below what the slots need, so
    startup is refused though the memory holds them (before: allocated_bytes was the one-layer stock pool)."""
    ns, dep = deploy
    standins_only(ns)
    kw = dict(num_layers=TRTLLM_LAYERS, num_kv_heads=2, head_dim=64, tokens_per_block=16, max_seq_len=TRTLLM_MAX_SEQ,
              max_batch_size=3, mapping=trtllm_standins.Mapping())
    probe = dep.manager_cls(trtllm_standins.KvCacheConfig(enable_block_reuse=False), "SELF", **kw)
    pools = sum(t.nbytes for t in probe.book.tensors()) + sum(
        getattr(st, f).nbytes for st in probe.layers for f in ("k_codes", "k_params", "v_codes", "v_params", "sink_k",
                                                               "sink_v", "recent_k", "recent_v"))
    per_token = dep.manager_cls.get_cache_size_per_token()
    need_bytes = 384 * per_token
    # memory for the slots and half the pools again: enough, unless the estimation's pools count as activations
    d = executor_driver(deploy, estimate=True, available_bytes=int(need_bytes / 0.9) + pools // 2)
    assert d.kv_config.max_gpu_total_bytes >= need_bytes and d.kv_config.max_tokens >= 384
    assert probe.get_kv_cache_stats().allocated_bytes == probe.stock_pool_bytes + pools


def test_add_dummy_requests_returning_none_is_passed_on(deploy):
    """Upstream's add_dummy_requests returns None when no block is free (no padding); the override iterated it."""
    ns, dep = deploy
    d = executor_driver(deploy, max_batch=1)
    req = ns.llm_request.LlmRequest(request_id=1, max_new_tokens=1, input_tokens=[1] * (TRTLLM_MAX_SEQ - 1))
    d.mgr.prepare_resources(trtllm_standins.ScheduledRequests([req], []))
    assert d.mgr.get_num_free_blocks() == 0
    assert d.mgr.add_dummy_requests([trtllm_standins.CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True) is None
    assert not d.mgr.dummy_ids
    d.mgr.free_resources(req)
    (pad,) = d.mgr.add_dummy_requests([trtllm_standins.CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True)
    assert d.mgr.slots_for([pad.py_request_id]) == [d.mgr.scratch]


# ---- executor loops vs the reference -----------------------------------------------------------------------



def test_plain_executor_loop_matches_reference(deploy):
    d = executor_driver(deploy)
    reqs = window_requests()
    d.run_plain(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 150


def test_overlap_executor_loop_matches_reference(deploy):
    """Bug: with forward(N+1) before update_resources(N), demotion in update_resources is one step late."""
    d = executor_driver(deploy)
    reqs = window_requests()
    d.run_overlap(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 150


def test_cuda_graph_warmup_capture_replay_with_dummy_requests(deploy, monkeypatch):
    """Bug: warmup/capture use dummy requests the host-side book never saw (KeyError); anything decided on the
    host at capture is frozen in the graph."""
    d = executor_driver(deploy)
    # request 6 comes first (C++ block 0 is its first INT2 page) and outlives the others: two padding rows per
    # replay for ~60 steps, enough to fill a window. Padding rows must never be stored (they point at the
    # scratch slot, which never takes a token), else its demotion would land in page 0.
    reqs = [Req(6, 5, 110)] + window_requests()[:3]
    d.run_graph(reqs, batch_size=3, monkeypatch=monkeypatch)
    assert all(r.done for r in reqs) and d.checked_outputs > 150
    assert not d.mgr.dummy_ids and not d.mgr.slots  # dummies and requests all released


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_mixed_key_bits_executor_loops_match_reference(deploy_mixed, loop):
    """Each layer's pages in its own width (layer 0: 4-bit keys, ``[N, H_kv, P, D / 2]`` codes), the
    layer's own cache ops, every step's cache and outputs equal to the reference of that layer's layout."""
    ns, dep = deploy_mixed
    d = executor_driver(deploy_mixed)
    assert dep.layer_layouts == (TRTLLM_LAYOUT.with_key_bits(4), TRTLLM_LAYOUT)
    assert dep.made_ops == [TRTLLM_LAYOUT.with_key_bits(4), TRTLLM_LAYOUT]  # one ops object per distinct layout
    assert [ops.layout.key.bits for ops in d.mgr.ops] == [4, 2]
    assert [st.k_codes.shape[-1] for st in d.mgr.layers] == [32, 16] and d.mgr.layers[0].v_codes.shape[-1] == 16
    reqs = window_requests()
    d.run_plain(reqs) if loop == "plain" else d.run_overlap(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 150


def test_finished_request_pages_are_reused(deploy):
    d = executor_driver(deploy, max_batch=1)
    reqs = [Req(1, 60, 20), Req(2, 70, 10)]
    d.run_plain(reqs)
    first, second = reqs[0].rows[-1], reqs[1].rows[-1]
    assert set(first) & set(second), f"request 2 got blocks {second}, none of request 1's {first}"
    assert all(r.done for r in reqs)


# ---- bad input at startup ----------------------------------------------------------------------------------


def test_max_seq_len_beyond_the_reserved_pages_fails_at_startup(deploy):
    ns, dep = deploy
    kw = dict(num_layers=TRTLLM_LAYERS, num_kv_heads=2, head_dim=64, tokens_per_block=16, max_batch_size=2,
              mapping=trtllm_standins.Mapping())
    cfg = functools.partial(trtllm_standins.KvCacheConfig, enable_block_reuse=False)
    too_long = 10**5
    ok = dep.manager_cls(cfg(), "SELF", max_seq_len=256, **kw)
    assert ok.book.max_length == 256 and ok.book.max_pages == TRTLLM_LAYOUT.pages_for(256)
    with pytest.raises(ValueError, match="tokens_per_block 32: the OSCAR cache needs tokens_per_block = the page "
                                         "size 16"):
        dep.manager_cls(cfg(), "SELF", max_seq_len=256, **{**kw, "tokens_per_block": 32})
    with pytest.raises(ValueError, match=r"model: 3 layers"):
        dep.manager_cls(cfg(), "SELF", max_seq_len=256, **{**kw, "num_layers": 3})
    # the stand-in C++ manager gives max_seq_len / P blocks per sequence; a shrunk pool must be refused
    class Small(dep.manager_cls):
        def get_max_resource_count(self):
            return 5

    with pytest.raises(ValueError, match=r"max_batch_size 2 x max_seq_len 256 needs 26 INT2 pages; 5 are reserved"):
        Small(cfg(), "SELF", max_seq_len=256, **kw)
    # a request longer than the pages reserved per slot: failed alone on admission, nothing written for it
    req = ns.llm_request.LlmRequest(request_id=7, max_new_tokens=too_long, input_tokens=[1] * 8)
    ok.prepare_resources(trtllm_standins.ScheduledRequests([req], []))
    assert ok.failed[7] == (f"request 7: prompt + max_new_tokens = {too_long + 8} tokens; the OSCAR cache reserved "
                            "256 per sequence (max_seq_len)")
    assert not ok.slots and req.state == ns.llm_request.LlmRequestState.GENERATION_COMPLETE


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_nonfinite_decode_token_fails_its_request_and_keeps_the_cache(deploy, loop):
    """A NaN key in one request's decode step: that request's cache stays at its last finite token (no later
    step writes it), and within two steps ``prepare_resources`` fails that request alone; the other request runs
    to its end exactly as the reference (before: ``prepare_resources`` raised, which upstream's executor answers by
    failing every active request)."""
    d = executor_driver(deploy)
    reqs = [Req(1, 20, 40), Req(2, 40, 30, nan_at=45)]
    d.run_plain(reqs) if loop == "plain" else d.run_overlap(reqs)
    assert reqs[1].poisoned and reqs[1].written == 45
    assert reqs[1].failed == ("request 2: a NaN/Inf key or value reached the OSCAR cache (its cache holds the tokens "
                              "of the steps before)")
    nan_step = 45 - 40 + 1  # step 0 the prefill, then one token per step: position 45 is fed in step 6
    assert nan_step < reqs[1].failed_step <= nan_step + 2, reqs[1].failed_step  # the next step, or one later
    assert all(r.done for r in reqs) and not reqs[0].failed and reqs[0].written >= 20 + 40 and d.checked_outputs > 80
    assert not d.mgr.slots and not d.mgr.failed


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_nonfinite_prompt_token_fails_its_request_alone(deploy, loop):
    """A NaN key in one request's prompt, batched with another prompt: that request's prompt is not committed and it
    fails alone within two steps; the other runs to its end exactly as the reference (before: the NaN prompt was
    committed into the cache, so the request decoded on; a page of NaN quantizes to garbage, never noticed)."""
    d = executor_driver(deploy)
    reqs = [Req(1, 30, 20), Req(2, 40, 30, nan_at=10)]
    d.run_plain(reqs) if loop == "plain" else d.run_overlap(reqs)
    assert reqs[1].poisoned and reqs[1].written == 0
    assert reqs[1].failed.startswith("request 2: a NaN/Inf key or value reached the OSCAR cache"), reqs[1].failed
    assert 0 < reqs[1].failed_step <= 2, reqs[1].failed_step  # the next step, or one later
    assert all(r.done for r in reqs) and not reqs[0].failed and reqs[0].generated >= 20 and d.checked_outputs > 40
    assert not d.mgr.slots and not d.mgr.failed


def test_a_request_the_cache_cannot_hold_fails_alone(deploy):
    """A request longer than max_seq_len among servable ones: it fails on admission, the others are served as
    the reference (before: ``ValueError`` out of ``prepare_resources``, every active request failed)."""
    d = executor_driver(deploy)
    reqs = [Req(1, 20, 30), Req(2, 40, TRTLLM_MAX_SEQ), Req(3, 30, 20)]
    d.run_plain(reqs)
    assert reqs[1].failed.startswith(f"request 2: prompt + max_new_tokens = {40 + TRTLLM_MAX_SEQ} tokens")
    assert reqs[1].written == 0 and reqs[1].failed_step == 0
    assert all(r.done for r in reqs) and [r.generated for r in (reqs[0], reqs[2])] == [30, 20]
    assert d.checked_outputs > 80 and not d.mgr.slots and not d.mgr.failed


# ---- the forward on upstream's execution stream --------------------------------------------------------------


@pytest.mark.parametrize("passed", [True, False], ids=["execution_stream_passed", "no_execution_stream"])
def test_admission_writes_are_ordered_before_the_forward_on_another_stream(deploy, passed):
    """Upstream runs the forward on ``execution_stream`` and ``prepare_resources`` on the current stream. With the
    current stream's writes held back as long as CUDA may hold them (tests/plugins/trtllm_streams.py), the
    forward must never read a tensor whose admission writes have not landed: request 3 takes the slot request 1
    frees, so a reset that has not landed leaves request 1's lengths in it. Upstream passing the execution stream
    to the manager (1.2 and later) or not (the manager's event then orders the writes), the same."""
    from trtllm_streams import SimulatedStreams

    sim = SimulatedStreams()
    d = executor_driver(deploy, max_batch=2, streams=sim, execution_stream="execution" if passed else None)
    reqs = [Req(1, 20, 4), Req(2, 40, 30), Req(3, 37, 12)]
    failure = None
    with sim.installed():
        try:
            d.run_plain(reqs)
        except AssertionError as e:  # the reference comparison of a stale read
            failure = e
    assert not sim.stale_reads, "\n".join(sim.stale_reads[:6])
    assert failure is None, failure
    assert all(r.done for r in reqs) and reqs[2].rows[0] != [] and d.checked_outputs > 30


# ---- configurations the OSCAR cache cannot serve: refused at startup, one line each ------------------------


def _manager_kwargs(**over):
    kw = dict(num_layers=TRTLLM_LAYERS, num_kv_heads=2, head_dim=64, tokens_per_block=16, max_seq_len=TRTLLM_MAX_SEQ,
              max_batch_size=2, mapping=trtllm_standins.Mapping())
    return {**kw, **over}


EagleDecodingConfig = type("EagleDecodingConfig", (), {})


@pytest.mark.parametrize("over,match", [
    ({"spec_config": EagleDecodingConfig()}, r"^speculative decoding \(EagleDecodingConfig\): the OSCAR cache serves"),
    ({"layer_mask": [True, False]}, r"^a layer_mask: the OSCAR cache serves the target model's own layers only"),
    ({"enable_block_reuse": True}, r"^kv_cache_config.enable_block_reuse: reused blocks would hold BF16 data"),
    ({"mapping": trtllm_standins.Mapping(world_size=2, pp_size=2)}, r"^pipeline parallelism \(pp_size 2\)"),
    ({"mapping": trtllm_standins.Mapping(world_size=2, tp_size=2)}, r"^tensor parallelism \(tp_size 2\)"),
], ids=["speculative", "layer_mask", "block_reuse", "pipeline", "tensor"])
def test_unservable_configurations_are_refused_at_startup_with_one_line(deploy, over, match):
    """Each setting the OSCAR cache cannot serve stops the manager's construction with one line naming it (before:
    speculative decoding, a layer_mask and block reuse were accepted -- a layer_mask then failed upstream's
    get_pp_layers assertion against the one-layer stock pool -- and pipeline parallelism was not named)."""
    ns, dep = deploy
    over = dict(over)  # the parameter is shared by both layouts' runs
    reuse = over.pop("enable_block_reuse", False)
    cfg = trtllm_standins.KvCacheConfig(enable_block_reuse=reuse)
    with pytest.raises(NotImplementedError, match=match) as e:
        dep.manager_cls(cfg, "SELF", **_manager_kwargs(**over))
    assert "\n" not in str(e.value)


def test_a_layer_mask_of_every_layer_is_served(deploy):
    """A layer_mask selecting every layer is no speculative draft: the manager serves (its stock pool has one
    layer, so the mask is not passed on to upstream's get_pp_layers)."""
    ns, dep = deploy
    cfg = trtllm_standins.KvCacheConfig(enable_block_reuse=False)
    mgr = dep.manager_cls(cfg, "SELF", **_manager_kwargs(layer_mask=[True] * TRTLLM_LAYERS))
    assert mgr.num_layers == 1


def test_chunked_prefill_without_a_chunk_kernel_is_refused_at_startup(deploy, monkeypatch):
    """Cache ops without a prompt-chunk kernel (the AOT bundle's) and upstream's runtime_features.chunked_prefill
    on: the first forward -- the KV-cache estimation's, at startup -- refuses with one line (before: the first
    later chunk of a long prompt raised inside serving)."""
    from oscar_export.plugins.trtllm.reference_ops import TorchCacheOps

    monkeypatch.setattr(TorchCacheOps, "chunked_prefill", False, raising=False)
    with pytest.raises(NotImplementedError, match=r"^enable_chunked_prefill: the OSCAR cache ops of this deployment "
                                                  r"have no kernel") as e:
        executor_driver(deploy, estimate=True, chunked_prefill=True)
    assert "\n" not in str(e.value)
