"""The OSCAR TensorRT-LLM adapter against stand-ins of TensorRT-LLM under its real module names.

Stand-ins (``trtllm_standins.py``) for the 1.2 and main layouts, with the signatures recorded in
``trtllm_signatures.json``; executor-loop replays (``trtllm_driver.py``: plain loop, overlap loop, CUDA-graph
warmup/capture/replay with dummy requests) compare the adapter's cache after every step with the reference
cache writer. The cache ops are the reference ones (``plugins/trtllm/reference_ops.py``, same semantics as the
AOT kernels, which tests/gpu/test_trtllm_gpu.py compares with the JIT on an H200).

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


def _driver(deploy, max_batch=3):
    ns, dep = deploy
    standins_only(ns)
    return Driver(ns, dep, max_batch, MAX_SEQ, _pretrained(dep))


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
            if getattr(ns, "real", False):
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


def test_worker_import_reinstalls_the_cache(ns, tmp_path, monkeypatch):
    """Bug: custom-module imports run in the driver process only. The registered model class lives in the
    deployment's trtllm_module, so a worker that re-imports it (upstream re-imports the module of every
    out-of-tree model class) installs the OSCAR cache manager in its own process."""
    standins_only(ns)
    import importlib
    import sys

    from oscar_export.build import SHIM

    root = tmp_path / "deploy"
    _checkpoint(root / "checkpoint"), _bundle(root / "kernels")
    (root / "trtllm_module").mkdir()
    (root / "trtllm_module" / "__init__.py").write_text(SHIM)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "trtllm_module", raising=False)
    importlib.import_module("trtllm_module")  # the driver process (--custom_module_dirs)
    cls = ns.modeling_utils.MODEL_CLASS_MAPPING["OscarLlamaForCausalLM"]
    assert cls.__module__ == "trtllm_module" and getattr(sys.modules["trtllm_module"], cls.__name__) is cls
    # a fresh worker: new TensorRT-LLM modules, nothing registered, then the re-import of cls.__module__
    worker = trtllm_standins.install(monkeypatch, ns.layout)
    monkeypatch.delitem(sys.modules, "trtllm_module")
    assert worker.modeling_utils.MODEL_CLASS_MAPPING == {}
    importlib.import_module(cls.__module__)
    mc = trtllm_standins.ModelConfig(pretrained_config=type("C", (), {"architectures": [cls.__name__]})())
    get_cls = worker.util.get_kv_cache_manager_cls
    mgr_cls = get_cls(mc) if ns.layout == "1.2" else get_cls(mc, None)
    assert getattr(mgr_cls, "is_oscar_cache", False), f"worker got {mgr_cls.__name__}"
    assert "OscarLlamaForCausalLM" in worker.modeling_utils.MODEL_CLASS_MAPPING


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
    with pytest.raises(ValueError, match="q_scaling 2.0 gives softmax scale 0.0625; the kernel bundle was compiled "
                                         "for 0.125"):
        dep.attention_cls(0, HEADS, 64, 2, None, q_scaling=2.0)
    assert dep.attention_cls(0, HEADS, 64, 2, None, q_scaling=1.0).scale == 0.125
    mc = trtllm_standins.ModelConfig(pretrained_config=_pretrained(dep), q_scaling=2.0)
    with pytest.raises(ValueError, match="q_scaling 2.0"):
        dep.model_cls(mc)


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
