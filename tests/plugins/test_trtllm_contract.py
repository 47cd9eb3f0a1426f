"""The OSCAR TensorRT-LLM adapter against stand-ins of TensorRT-LLM under its real module names.

Stand-ins (``trtllm_standins.py``, whose docstring tables each upstream fact with its file and commit) for the
1.2 and main layouts, with the signatures recorded in ``trtllm_signatures.json``. The model is built by
``AutoModelForCausalLM.from_config`` on a frozen ``ModelConfig``, each layer's ``Attention.forward`` gets the
packed ``q|k|v`` rows before RoPE, ``KvCacheCreator`` runs the estimation / teardown / rebuild, a spawned
worker process unpickles the model-class mapping (``trtllm_worker.py``); executor-loop replays
(``trtllm_driver.py``: plain loop, overlap loop, CUDA-graph warmup/capture/replay with upstream's padding
request) compare the adapter's cache after every step with the reference cache writer. The cache ops are the
reference ones (``plugins/trtllm/reference_ops.py``, same semantics as the AOT kernels, which
tests/gpu/test_trtllm_gpu.py compares with the JIT on an H200). Nothing here ran against TensorRT-LLM itself.

The adapter before issue 28 (commit 0fca1be), on these stand-ins (1.2 layout), 2026-12-02:

    test_plain_executor_loop_matches_reference (every loop)  RuntimeError: shape '[5, 4, 64]' is invalid for
                                                           input of size 2560 (packed, un-rotated QKV)
    test_frozen_config_startup_wires_every_layer_...      (rope_fusion, support_fused_qkv, rotary_emb) =
                                                           (True, True, False)
    test_kv_cache_estimation_builds_twice_...              the estimation's first dummy request: shape
                                                           '[127, 4, 64]' is invalid for input of size 65024
    test_worker_process_imports_the_module_and_serves      the same, inside the spawned worker
    test_add_dummy_requests_returning_none_is_passed_on    TypeError: 'NoneType' object is not iterable
    test_kv_cache_budget_below_the_slots_fails_at_startup  no OSCAR get_cache_size_per_token (TypeError)
    test_startup_check_asserts_every_wiring_flag,          DID NOT RAISE
    test_startup_refuses_when_the_cache_manager_...,
    test_prespawned_workers_without_the_module_path_...

Where TensorRT-LLM itself imports, ``LAYOUTS`` gains ``"real"`` and the registration tests run on it
unchanged (UNTESTED here: it never imports on these machines).

The adapter before issue 12 (commit 7e9cb80), driven through the same stand-ins (1.2 layout) with its device
ops replaced by the reference, failed each bug's test (2026-12-01):

    test_registration_selects_the_oscar_model_and_cache   nothing registered; the dispatch returns the stock
                                                           KVCacheManager (plain BF16, no error)
    test_worker_import_reinstalls_the_cache               (same: no registration to re-import)
    test_forward_refuses_the_stock_kv_cache_manager       AttributeError: 'KVCacheManager' ... 'layers'
    test_overlap_executor_loop_matches_reference          lengths (16, 0, 25) at token 42, layout.split (16, 0, 26)
    test_cuda_graph_warmup_capture_replay_with_dummy_...  no add_dummy_requests; KeyError: 1000000
    test_chunked_prefill_is_context_by_num_contexts       chunk 2 taken for decode: "recent window is full"
    test_q_scaling_is_honoured                            q_scaling=2.0 accepted silently
    test_startup_check_refuses_a_stock_attention_layer    no startup check existed
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch

from oscar_export.kernels.aot.bundle import serving_specs
from oscar_export.kernels.layout import KVCacheLayout

import trtllm_standins
from fake_bundle import fake_bundle
from trtllm_driver import Driver, Req

LAYOUT = KVCacheLayout.default(2, 64, sink=16, window=16, page_size=16)  # S0 16, W+P 32, P 16
HEADS, LAYERS, MAX_SEQ = 4, 2, 128
#: issue 17's per-layer key widths: 4-bit key pages in layer 0, 2-bit in layer 1
MIXED_KEY_BITS = (4, 2)
SIGNATURES = json.loads((Path(__file__).parent / "trtllm_signatures.json").read_text())["layouts"]


def _real_trtllm() -> bool:
    try:
        return importlib.util.find_spec("tensorrt_llm") is not None and bool(__import__("tensorrt_llm"))
    except Exception:
        return False


LAYOUTS = ["1.2", "main"] + (["real"] if _real_trtllm() else [])


def _config(**over):
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_attention_heads": HEADS,
            "num_key_value_heads": 2, "hidden_size": HEADS * 64, "head_dim": 64, "num_hidden_layers": LAYERS,
            "intermediate_size": 64, "vocab_size": 32, **over}


def _checkpoint(root: Path, layout=LAYOUT, key_bits=(), **over) -> Path:
    from transformers import LlamaConfig

    from oscar_export.calibration.artifact import OscarArtifact
    from oscar_export.plugins.trtllm.deployment import trtllm_config

    root.mkdir(parents=True)
    cfg = _config(**over)
    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    art = OscarArtifact.identity(hf, layout).with_values_prerotated()
    (art.with_key_bits(key_bits) if key_bits else art).save(root / "oscar")
    cfg = {**cfg, "oscar": {"format_version": 1, "artifact": "oscar", "layout": layout.to_dict()}}
    if cfg["model_type"] in ("llama",):
        cfg = trtllm_config(cfg)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def _bundle(root: Path, layout=LAYOUT, heads=HEADS, scale=64 ** -0.5, archs=("sm_80", "sm_90"), key_bits=None) -> Path:
    return fake_bundle(root, serving_specs(layout, heads, scale, probes=False, trt=False, key_bits=key_bits),
                       archs=archs)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The replays are thousands of tiny CPU ops: one intra-op thread is several times faster than many."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=LAYOUTS)
def ns(request, monkeypatch):
    if request.param == "real":
        return trtllm_standins.real_namespace()
    return trtllm_standins.install(monkeypatch, request.param)


def standins_only(ns):
    """The executor replays drive the stand-in C++ block manager and configs; the real one needs a GPU."""
    if getattr(ns, "real", False):
        pytest.skip("replays the stand-in C++ block manager (the real package: run it under trtllm-serve)")


@pytest.fixture
def deploy(ns, tmp_path):
    from oscar_export.plugins.trtllm import register
    from oscar_export.plugins.trtllm.reference_ops import TorchCacheOps

    ckpt, bundle = _checkpoint(tmp_path / "ckpt"), _bundle(tmp_path / "kernels")
    dep = register(ckpt, bundle, arch="sm_90", ops_factory=lambda lay: TorchCacheOps(lay, HEADS, 64 ** -0.5))
    return ns, dep


def _pretrained(dep):
    from types import SimpleNamespace

    return SimpleNamespace(**{k: v for k, v in dep.config.items() if k != "oscar"})


def _driver(deploy, max_batch=3, **kw):
    ns, dep = deploy
    standins_only(ns)
    return Driver(ns, dep, max_batch, MAX_SEQ, _pretrained(dep), **kw)


# ---- registration: the real extension points ---------------------------------------------------------------


def test_standins_mirror_the_recorded_signatures(ns):
    """Stand-ins: exactly the recorded upstream signatures. The real package (where it imports): every recorded
    parameter the adapter relies on is there."""
    objs = {"AttentionBackend": ns.interface.AttentionBackend, "KVCacheManager": ns.resource_manager.KVCacheManager,
            "get_kv_cache_manager_cls": ns.util.get_kv_cache_manager_cls,
            "register_auto_model": ns.modeling_utils.register_auto_model}
    for path, entry in SIGNATURES[ns.layout]["files"].items():
        for name, want in entry["signatures"].items():
            owner, _, attr = name.partition(".")
            fn = getattr(objs[owner], attr) if attr else objs[owner]
            if want == ["@classmethod"]:  # upstream's Attention.__init__ calls it on the class
                assert isinstance(inspect.getattr_static(objs[owner], attr), classmethod), f"{path}: {name}"
                assert _sig(fn) == [], f"{path}: {name} takes {_sig(fn)}"
            elif getattr(ns, "real", False):
                missing = [p for p in want if p.rstrip("=") not in {x.rstrip("=") for x in _sig(fn)}]
                assert not missing, f"{path}: {name} has no {missing}"
            else:
                assert _sig(fn) == want, f"{path}: {name} stand-in {_sig(fn)} != recorded {want}"


def _sig(fn) -> list[str]:
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        elif p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        else:
            out.append(p.name + ("=" if p.default is not p.empty else ""))
    return out


def test_registration_selects_the_oscar_model_and_cache(deploy):
    """Bug: register() built the classes and kept them; upstream selects from fixed lists -> plain BF16."""
    ns, dep = deploy
    arch = dep.config["architectures"][0]
    assert arch == "OscarLlamaForCausalLM"
    assert ns.modeling_utils.MODEL_CLASS_MAPPING[arch] is dep.model_cls
    d = _driver(deploy)
    assert type(d.mgr) is dep.manager_cls and isinstance(d.mgr, ns.resource_manager.KVCacheManager)
    assert all(type(b) is dep.attention_cls for b in d.backends) and len(d.backends) == LAYERS
    assert isinstance(d.backends[0], ns.interface.AttentionBackend)
    other = trtllm_standins.ModelConfig(pretrained_config=type("C", (), {"architectures": ["LlamaForCausalLM"]})())
    get_cls = ns.util.get_kv_cache_manager_cls
    stock = get_cls(other) if ns.layout == "1.2" else get_cls(other, None)
    assert stock is ns.resource_manager.KVCacheManager  # other models keep the stock dispatch
    # the stock BF16 pool is built for one layer and max_batch full sequences only
    assert d.mgr.num_layers == 1 and d.mgr.get_max_resource_count() == 3 * (MAX_SEQ // 16)


def _deploy_dir(root: Path) -> Path:
    """A deployment directory as ``oscar-export build`` lays it out (fake kernel bundle)."""
    from oscar_export.build import SHIM

    _checkpoint(root / "checkpoint"), _bundle(root / "kernels")
    (root / "trtllm_module").mkdir()
    (root / "trtllm_module" / "__init__.py").write_text(SHIM)
    return root


@pytest.mark.parametrize("layout", ["1.2", pytest.param("main", marks=pytest.mark.slow)])  # ~5 s CPU each
def test_worker_process_imports_the_module_and_serves(layout, tmp_path, monkeypatch):
    """Bug: the worker re-import was tested in the same process. Here the worker is a separate spawned process
    that gets only the parent's sys.path (as MpiPoolSession gives its MPI workers) and the pickled
    MODEL_CLASS_MAPPING: unpickling imports trtllm_module there, which registers the model and installs the cache
    manager in that process; it then starts (from_config, KV-cache estimation, rebuild) and serves."""
    ns = trtllm_standins.install(monkeypatch, layout)
    import multiprocessing
    import os
    import pickle
    import sys

    import trtllm_worker

    root = _deploy_dir(tmp_path / "deploy")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "trtllm_module", raising=False)
    importlib.import_module("trtllm_module")  # the driver process (--custom_module_dirs)
    cls = ns.modeling_utils.MODEL_CLASS_MAPPING["OscarLlamaForCausalLM"]
    assert cls.__module__ == "trtllm_module"
    blob = pickle.dumps(dict(ns.modeling_auto.MODEL_CLASS_MAPPING))  # what executor/proxy.py sends
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=trtllm_worker.worker_main, args=(ns.layout, blob, queue))
    worker.start()
    try:
        res = queue.get(timeout=300)
    finally:
        worker.join(60)
    assert res["ok"], res.get("error")
    assert res["pid"] != os.getpid() and not res["imported_before"]
    assert res["manager"] == "OscarKVCacheManager" and res["estimated"] and res["done"]
    assert res["registered"] == ["OscarLlamaForCausalLM"] and res["checked"] > 20


def test_prespawned_workers_without_the_module_path_fail_at_startup(ns, tmp_path, monkeypatch):
    """Pre-spawned MPI workers (TLLM_SPAWN_PROXY_PROCESS=1) do not get the driver's sys.path: unless the
    deployment directory is on PYTHONPATH, importing trtllm_module refuses with one line saying what to set."""
    standins_only(ns)
    import sys

    root = _deploy_dir(tmp_path / "deploy")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("TLLM_SPAWN_PROXY_PROCESS", "1")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delitem(sys.modules, "trtllm_module", raising=False)
    with pytest.raises(RuntimeError, match=f"pre-spawned .* cannot import 'trtllm_module': add {root} to PYTHONPATH"):
        importlib.import_module("trtllm_module")
    monkeypatch.delitem(sys.modules, "trtllm_module", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(root))
    importlib.import_module("trtllm_module")
    assert "OscarLlamaForCausalLM" in ns.modeling_utils.MODEL_CLASS_MAPPING


# ---- startup on upstream's construction and estimation paths (issue 28) ------------------------------------


def test_frozen_config_startup_wires_every_layer_for_the_oscar_backend(deploy):
    """Bug: the model constructor set attn_backend on a config from_config had frozen, swallowed the error and
    swapped .attn into layers wired for TRTLLM (fused RoPE, no rotary_emb, fused QKV): the first forward got packed,
    un-rotated q/k/v. Now each layer comes out unfused and the executor's config keeps its backend."""
    ns, dep = deploy
    standins_only(ns)
    mc = trtllm_standins.ModelConfig(pretrained_config=_pretrained(dep))
    model = ns.modeling_auto.AutoModelForCausalLM.from_config(mc)
    assert mc._frozen and mc.attn_backend == "TRTLLM"  # what KvCacheCreator and the engine read afterwards
    with pytest.raises(AttributeError, match="frozen"):
        mc.attn_backend = "VANILLA"
    assert len(model.layers) == LAYERS
    for m in model.layers:
        assert type(m.attn) is dep.attention_cls
        assert (m.rope_fusion, m.support_fused_qkv, m.rotary_emb is not None) == (False, False, True)
    assert not dep.attention_cls.support_fused_rope() and not dep.attention_cls.support_fused_qkv()


@pytest.mark.parametrize("flag,value", [("rope_fusion", True), ("support_fused_qkv", True), ("rotary_emb", None)])
def test_startup_check_asserts_every_wiring_flag(deploy, flag, value):
    """check_model checked only the backend class; a layer wired for a fused backend must be refused too."""
    ns, dep = deploy
    from oscar_export.plugins.trtllm.model import check_model

    d = _driver(deploy)
    check_model(d.model, dep.upstream, dep, dep.attention_cls)  # passes as built
    setattr(d.model.layers[1], flag, value)
    with pytest.raises(RuntimeError, match=f"wired for a fused backend \\(layers.1.{flag} = "):
        check_model(d.model, dep.upstream, dep, dep.attention_cls)


def test_startup_refuses_when_the_cache_manager_substitution_did_not_take(deploy):
    """A process whose get_kv_cache_manager_cls is not the OSCAR dispatch (the module was not imported there)
    must refuse to build the model, not serve a plain BF16 cache."""
    ns, dep = deploy
    standins_only(ns)
    util = ns.util
    util.get_kv_cache_manager_cls = util.get_kv_cache_manager_cls.oscar_original
    mc = trtllm_standins.ModelConfig(pretrained_config=_pretrained(dep))
    with pytest.raises(RuntimeError, match="get_kv_cache_manager_cls is not the OSCAR dispatch in process"):
        ns.modeling_auto.AutoModelForCausalLM.from_config(mc)


def test_kv_cache_estimation_builds_twice_frees_the_first_and_serves(deploy):
    """Upstream builds the KV manager for the estimation, runs dummy context requests of max_num_tokens, sizes the
    cache from get_cache_size_per_token, shuts the manager down and builds it again. The OSCAR pools of the first
    build are released by shutdown (the engine may still hold that manager), the budget is counted in OSCAR
    bytes per token, and the rebuilt manager serves."""
    import gc
    import weakref

    ns, dep = deploy
    d = _driver(deploy, estimate=True)
    assert d.estimated and d.creator.dummy_requests == [MAX_SEQ - 1, 1]
    old = d.estimation_mgr
    assert old is not None and old is not d.mgr and type(d.mgr) is dep.manager_cls
    gc.collect()
    assert old.book is None and not old.layers and not old.step_layers  # the pools went with shutdown()
    pools = [weakref.ref(getattr(s, f)) for s in d.mgr.layers for f in ("k_codes", "v_codes")]
    per_page = sum(getattr(s, f)[0].numel() * getattr(s, f).element_size() for s in d.mgr.layers
                   for f in ("k_codes", "k_params", "v_codes", "v_params"))
    per_token = dep.manager_cls.get_cache_size_per_token(d.model_config, trtllm_standins.Mapping())
    assert per_token == -(-per_page // LAYOUT.page_size) + 2 * 2 * LAYOUT.num_kv_heads * LAYOUT.head_dim
    assert per_token < ns.resource_manager.KVCacheManager.get_cache_size_per_token(d.model_config, None)
    assert d.kv_config.max_tokens == (1 << 34) // per_token  # the budget, in OSCAR tokens
    assert d.mgr.layers[0].k_codes.shape[0] == d.mgr.get_max_resource_count()
    reqs = _requests()[:3]
    d.run_plain(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 100
    d.mgr.shutdown()
    gc.collect()
    assert all(r() is None for r in pools)


def test_kv_cache_budget_below_the_slots_fails_at_startup(deploy):
    """The memory left after the estimation must hold max_batch_size sequences of max_seq_len: else one clear
    error at the rebuild (not an out-of-memory later)."""
    ns, dep = deploy
    per_token = dep.manager_cls.get_cache_size_per_token()
    with pytest.raises(ValueError, match=r"max_batch_size 3 x max_seq_len 128 needs 384 tokens of OSCAR cache; "
                                         r"the KV cache memory holds 100"):
        _driver(deploy, estimate=True, available_bytes=100 * per_token)
    # upstream versions that do not pass is_estimating_kv_cache: the estimation's max_tokens is no budget
    kw = dict(num_layers=LAYERS, num_kv_heads=2, head_dim=64, tokens_per_block=16, max_seq_len=MAX_SEQ,
              max_batch_size=3, mapping=trtllm_standins.Mapping())
    mgr = dep.manager_cls(trtllm_standins.KvCacheConfig(max_tokens=100), "SELF", **kw)
    assert mgr.get_max_resource_count() == 3 * MAX_SEQ // 16


def test_add_dummy_requests_returning_none_is_passed_on(deploy):
    """Upstream's add_dummy_requests returns None when no block is free (no padding); the override iterated it."""
    ns, dep = deploy
    d = _driver(deploy, max_batch=1)
    req = ns.llm_request.LlmRequest(request_id=1, max_new_tokens=1, input_tokens=[1] * (MAX_SEQ - 1))
    d.mgr.prepare_resources(trtllm_standins.ScheduledRequests([req], []))
    assert d.mgr.get_num_free_blocks() == 0
    assert d.mgr.add_dummy_requests([trtllm_standins.CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True) is None
    assert not d.mgr.dummy_ids
    d.mgr.free_resources(req)
    (pad,) = d.mgr.add_dummy_requests([trtllm_standins.CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True)
    assert d.mgr.slots_for([pad.py_request_id]) == [d.mgr.scratch]


def test_startup_check_refuses_a_stock_attention_layer(deploy):
    """Startup check: a model with any layer not on the OSCAR backend raises at construction."""
    ns, dep = deploy
    from oscar_export.plugins.trtllm.model import check_model

    d = _driver(deploy)
    check_model(d.model, dep.upstream, dep, dep.attention_cls)  # passes as built
    d.model.layers[1].attn = ns.TrtllmAttention(1, HEADS, 64, 2)
    with pytest.raises(RuntimeError, match=r"not on the OSCAR backend: \['layers.1 \(TrtllmAttention\)'\]"):
        check_model(d.model, dep.upstream, dep, dep.attention_cls)


def test_startup_check_compares_heads_with_the_family_table(deploy):
    """The backends' (heads, KV heads, head_dim) must be what the family table read from the checkpoint."""
    ns, dep = deploy
    from dataclasses import replace

    from oscar_export.plugins.trtllm.model import check_model

    d = _driver(deploy)
    assert (dep.facts.num_heads, dep.facts.num_kv_heads, dep.facts.head_dim) == (HEADS, 2, 64)
    dep.facts = replace(dep.facts, num_kv_heads=1)
    with pytest.raises(RuntimeError, match=r"are not \(heads, KV heads, head_dim\) \(\d+, 1, 64\) of the checkpoint"):
        check_model(d.model, dep.upstream, dep, dep.attention_cls)


def test_forward_refuses_the_stock_kv_cache_manager(deploy):
    """Bug: metadata.kv_cache_manager is the stock KVCacheManager when the OSCAR cache is not installed."""
    ns, dep = deploy
    d = _driver(deploy)
    stock = ns.resource_manager.KVCacheManager(trtllm_standins.KvCacheConfig(max_tokens=1024), "SELF", num_layers=2,
                                               num_kv_heads=2, head_dim=64, tokens_per_block=16, max_seq_len=256,
                                               max_batch_size=2, mapping=trtllm_standins.Mapping())
    md = ns.interface.AttentionMetadata(kv_cache_manager=stock, seq_lens=torch.tensor([1]), num_contexts=0,
                                        request_ids=[1])
    q, kv = torch.zeros(1, HEADS * 64).bfloat16(), torch.zeros(1, 128).bfloat16()
    with pytest.raises(RuntimeError, match="got a KVCacheManager as the KV cache manager"):
        d.backends[0].forward(q, kv, kv, md)


def test_q_scaling_is_honoured(deploy):
    """Bug: q_scaling was ignored. The kernel's scale is a compile-time constant: a q_scaling that changes it
    is refused at model build time; the prefill attention uses the same scale."""
    ns, dep = deploy
    standins_only(ns)
    with pytest.raises(ValueError, match="q_scaling 2.0 gives softmax scale 0.0625; the kernel bundle was compiled "
                                         "for 0.125"):
        dep.attention_cls(0, HEADS, 64, 2, None, q_scaling=2.0)
    assert dep.attention_cls(0, HEADS, 64, 2, None, q_scaling=1.0).scale == 0.125
    pretrained = _pretrained(dep)
    pretrained.q_scaling = 2.0  # the stand-in model passes it to every Attention
    with pytest.raises(ValueError, match="q_scaling 2.0"):
        ns.modeling_auto.AutoModelForCausalLM.from_config(trtllm_standins.ModelConfig(pretrained_config=pretrained))


# ---- executor loops vs the reference -----------------------------------------------------------------------

#: prompts around the windows (S0 16, W+P 32, P 16) and enough steps for demotions in every request; request 5
#: ends its prefill with a full recent window while others decode in the same step (it must not demote then).
def _requests():
    return [Req(1, 5, 45), Req(2, 33, 35), Req(3, 49, 16), Req(4, 16, 40), Req(5, 48, 20)]


def test_plain_executor_loop_matches_reference(deploy):
    d = _driver(deploy)
    reqs = _requests()
    d.run_plain(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 150


def test_overlap_executor_loop_matches_reference(deploy):
    """Bug: with forward(N+1) before update_resources(N), demotion in update_resources is one step late."""
    d = _driver(deploy)
    reqs = _requests()
    d.run_overlap(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 150


def test_cuda_graph_warmup_capture_replay_with_dummy_requests(deploy, monkeypatch):
    """Bug: warmup/capture use dummy requests the host-side book never saw (KeyError); anything decided on the
    host at capture is frozen in the graph."""
    d = _driver(deploy)
    # request 6 comes first (C++ block 0 is its first INT2 page) and outlives the others: two padding rows per
    # replay for ~60 steps, enough to fill a window. Padding rows must never be stored (they point at the
    # scratch slot, which never takes a token), else its demotion would land in page 0.
    reqs = [Req(6, 5, 110)] + _requests()[:3]
    d.run_graph(reqs, batch_size=3, monkeypatch=monkeypatch)
    assert all(r.done for r in reqs) and d.checked_outputs > 150
    assert not d.mgr.dummy_ids and not d.mgr.slots  # dummies and requests all released


@pytest.fixture
def deploy_mixed(ns, tmp_path):
    """A checkpoint with 4-bit keys in layer 0 (``key_bits``) and a bundle with both widths' kernels."""
    from oscar_export.plugins.trtllm import register
    from oscar_export.plugins.trtllm.reference_ops import TorchCacheOps

    ckpt = _checkpoint(tmp_path / "ckpt", key_bits=MIXED_KEY_BITS)
    bundle = _bundle(tmp_path / "kernels", key_bits=MIXED_KEY_BITS)
    made = []

    def ops(lay):
        made.append(lay)
        return TorchCacheOps(lay, HEADS, 64 ** -0.5)

    dep = register(ckpt, bundle, arch="sm_90", ops_factory=ops)
    dep.made_ops = made
    return ns, dep


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_mixed_key_bits_executor_loops_match_reference(deploy_mixed, loop):
    """Issue 17: each layer's pages in its own width (layer 0: 4-bit keys, ``[N, H_kv, P, D / 2]`` codes), the
    layer's own cache ops, every step's cache and outputs equal to the reference of that layer's layout."""
    ns, dep = deploy_mixed
    d = _driver(deploy_mixed)
    assert dep.layer_layouts == (LAYOUT.with_key_bits(4), LAYOUT)
    assert dep.made_ops == [LAYOUT.with_key_bits(4), LAYOUT]  # one ops object per distinct layout
    assert [ops.layout.key.bits for ops in d.mgr.ops] == [4, 2]
    assert [st.k_codes.shape[-1] for st in d.mgr.layers] == [32, 16] and d.mgr.layers[0].v_codes.shape[-1] == 16
    reqs = _requests()
    d.run_plain(reqs) if loop == "plain" else d.run_overlap(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 150


def test_chunked_prefill_is_context_by_num_contexts(deploy):
    """Bug: a later prompt chunk (cached tokens > 0) was taken for a decode step (``cached == 0`` test)."""
    d = _driver(deploy)
    reqs = [Req(1, 70, 12, chunk=24), Req(2, 30, 30)]
    d.run_plain(reqs)
    assert all(r.done for r in reqs) and d.checked_outputs > 50


def test_finished_request_pages_are_reused(deploy):
    d = _driver(deploy, max_batch=1)
    reqs = [Req(1, 60, 20), Req(2, 70, 10)]
    d.run_plain(reqs)
    first, second = reqs[0].rows[-1], reqs[1].rows[-1]
    assert set(first) & set(second), f"request 2 got blocks {second}, none of request 1's {first}"
    assert all(r.done for r in reqs)


# ---- bad input at startup ----------------------------------------------------------------------------------


def test_bad_deployments_fail_at_startup(ns, tmp_path):
    standins_only(ns)
    from oscar_export.kernels.aot.manifest import BundleError
    from oscar_export.plugins.trtllm import register

    ckpt = _checkpoint(tmp_path / "ckpt")
    other = KVCacheLayout.default(2, 64, sink=16, window=64, page_size=16)
    with pytest.raises(BundleError, match=r"no \['decode_split', .*kernels for this checkpoint's oscar section"):
        register(ckpt, _bundle(tmp_path / "b1", layout=other), arch="sm_90")
    with pytest.raises(BundleError, match=r"built for \['sm_80'\], this GPU is sm_90"):
        register(ckpt, _bundle(tmp_path / "b2", archs=("sm_80",)), arch="sm_90")
    with pytest.raises(BundleError, match="compiled for softmax scale"):
        register(ckpt, _bundle(tmp_path / "b3", scale=0.1), arch="sm_90")
    with pytest.raises(NotImplementedError, match="model family 'qwen2' is not served"):
        register(_checkpoint(tmp_path / "q", model_type="qwen2"), _bundle(tmp_path / "b4"), arch="sm_90")
    mixed = _checkpoint(tmp_path / "k4", key_bits=MIXED_KEY_BITS)
    with pytest.raises(BundleError, match=r"no \['decode_split', .*kernels for this checkpoint's oscar section "
                                          r"\(layout tag .*_k4, 4-bit keys\)"):
        register(mixed, _bundle(tmp_path / "b5"), arch="sm_90")  # the bundle has the 2-bit kernels only


def test_the_checkpoints_oscar_section_is_read_as_export_writes_it(tmp_path):
    """Bug (issue 30): the deployment read config.json with a bare ``json.loads`` and checked the section itself: an
    artifact outside the checkpoint (``"artifact": "../elsewhere"``) was loaded, a section of another format version
    accepted, a repeated key silently took its last value. It reads it as ``oscar_export.export.read_export`` does."""
    from oscar_export.plugins.trtllm.deployment import OscarDeployment

    ckpt = _checkpoint(tmp_path / "ckpt")
    bundle = _bundle(tmp_path / "b")
    OscarDeployment(ckpt, bundle, arch="sm_90")  # as written: loads
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "oscar").rename(tmp_path / "elsewhere")
    (ckpt / "config.json").write_text(json.dumps({**cfg, "oscar": {**cfg["oscar"], "artifact": "../elsewhere"}}))
    with pytest.raises(ValueError, match=r"the artifact '\.\./elsewhere' is outside the checkpoint"):
        OscarDeployment(ckpt, bundle, arch="sm_90")
    (tmp_path / "elsewhere").rename(ckpt / "oscar")
    (ckpt / "config.json").write_text(json.dumps({**cfg, "oscar": {**cfg["oscar"], "format_version": 7}}))
    with pytest.raises(ValueError, match=r"no 'oscar' section of format 1"):
        OscarDeployment(ckpt, bundle, arch="sm_90")
    (ckpt / "config.json").write_text(json.dumps(cfg)[:-1] + ', "oscar": {}}')
    with pytest.raises(ValueError, match=r"duplicate key 'oscar'"):
        OscarDeployment(ckpt, bundle, arch="sm_90")


def test_max_seq_len_beyond_the_reserved_pages_fails_at_startup(deploy):
    ns, dep = deploy
    kw = dict(num_layers=LAYERS, num_kv_heads=2, head_dim=64, tokens_per_block=16, max_batch_size=2,
              mapping=trtllm_standins.Mapping())
    cfg = trtllm_standins.KvCacheConfig
    too_long = 10**5
    ok = dep.manager_cls(cfg(), "SELF", max_seq_len=256, **kw)
    assert ok.book.max_length == 256 and ok.book.max_pages == LAYOUT.pages_for(256)
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
    # a request longer than the pages reserved per slot: refused on admission, before anything is written
    req = ns.llm_request.LlmRequest(request_id=7, max_new_tokens=too_long, input_tokens=[1] * 8)
    with pytest.raises(ValueError, match=f"request 7: prompt \\+ max_new_tokens = {too_long + 8} tokens; the OSCAR "
                                         "cache reserved 256 per sequence"):
        ok.prepare_resources(trtllm_standins.ScheduledRequests([req], []))
    assert not ok.slots


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_nonfinite_decode_token_fails_its_request_and_keeps_the_cache(deploy, loop):
    """A NaN key in one request's decode step: that request's cache stays at its last finite token (no later
    step writes it), the others go on exactly as the reference, and within two steps ``prepare_resources``
    raises ``NonFiniteKV`` naming the request (before: the executor counted the token the cache refused, so
    every later position of the request was off by one, silently)."""
    from oscar_export.plugins.trtllm.cache import NonFiniteKV

    d = _driver(deploy)
    reqs = [Req(1, 20, 40), Req(2, 40, 30, nan_at=45)]
    with pytest.raises(NonFiniteKV, match="request 2"):
        d.run_plain(reqs) if loop == "plain" else d.run_overlap(reqs)
    assert reqs[1].poisoned and reqs[1].written == 45
    nan_step = 1 + (45 - 40 + 1)  # one prefill step, then one token per step: position 45 is fed in step 7
    assert d.steps <= nan_step + 1, d.steps  # the plain loop stops before step 8's forward, overlap runs it
    d.check_cache(reqs)  # request 2 at 45 tokens, request 1 as the reference
