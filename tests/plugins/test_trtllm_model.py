"""``register()`` and the out-of-tree model (plugins/trtllm/model.py) on the stand-ins (tests/plugins/conftest.py): the
registration upstream selects from, the worker process that imports the deployment's module, the frozen-config
startup, and the startup checks (wiring flags, the cache-manager substitution, stock layers, the family table)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import trtllm_standins
from helpers import (
    TRTLLM_HEADS,
    TRTLLM_LAYERS,
    TRTLLM_MAX_SEQ,
    executor_driver,
    pretrained_config,
    standins_only,
    trtllm_bundle,
    trtllm_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_registration_selects_the_oscar_model_and_cache(deploy):
    """Bug: register() built the classes and kept them; upstream selects from fixed lists -> plain BF16."""
    ns, dep = deploy
    arch = dep.config["architectures"][0]
    assert arch == "OscarLlamaForCausalLM"
    assert ns.modeling_utils.MODEL_CLASS_MAPPING[arch] is dep.model_cls
    d = executor_driver(deploy)
    assert type(d.mgr) is dep.manager_cls and isinstance(d.mgr, ns.resource_manager.KVCacheManager)
    assert all(type(b) is dep.attention_cls for b in d.backends) and len(d.backends) == TRTLLM_LAYERS
    assert isinstance(d.backends[0], ns.interface.AttentionBackend)
    other = trtllm_standins.ModelConfig(pretrained_config=type("C", (), {"architectures": ["LlamaForCausalLM"]})())
    get_cls = ns.util.get_kv_cache_manager_cls
    stock = get_cls(other) if ns.layout == "1.2" else get_cls(other, None)
    assert stock is ns.resource_manager.KVCacheManager  # other models keep the stock dispatch
    # the stock BF16 pool is built for one layer and max_batch full sequences only
    assert d.mgr.num_layers == 1 and d.mgr.get_max_resource_count() == 3 * (TRTLLM_MAX_SEQ // 16)


def _deploy_dir(root: Path) -> Path:
    """A deployment directory as ``oscar-export build`` lays it out (fake kernel bundle)."""
    from oscar_export.build import SHIM

    trtllm_checkpoint(root / "checkpoint"), trtllm_bundle(root / "kernels")
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


def test_frozen_config_startup_wires_every_layer_for_the_oscar_backend(deploy):
    """Bug: the model constructor set attn_backend on a config from_config had frozen, swallowed the error and
    swapped .attn into layers wired for TRTLLM (fused RoPE, no rotary_emb, fused QKV): the first forward got packed,
    un-rotated q/k/v. Now each layer comes out unfused and the executor's config keeps its backend."""
    ns, dep = deploy
    standins_only(ns)
    mc = trtllm_standins.ModelConfig(pretrained_config=pretrained_config(dep))
    model = ns.modeling_auto.AutoModelForCausalLM.from_config(mc)
    assert mc._frozen and mc.attn_backend == "TRTLLM"  # what KvCacheCreator and the engine read afterwards
    with pytest.raises(AttributeError, match="frozen"):
        mc.attn_backend = "VANILLA"
    assert len(model.layers) == TRTLLM_LAYERS
    for m in model.layers:
        assert type(m.attn) is dep.attention_cls
        assert (m.rope_fusion, m.support_fused_qkv, m.rotary_emb is not None) == (False, False, True)
    assert not dep.attention_cls.support_fused_rope() and not dep.attention_cls.support_fused_qkv()


@pytest.mark.parametrize("flag,value", [("rope_fusion", True), ("support_fused_qkv", True), ("rotary_emb", None)])
def test_startup_check_asserts_every_wiring_flag(deploy, flag, value):
    """check_model checked only the backend class; a layer wired for a fused backend must be refused too."""
    ns, dep = deploy
    from oscar_export.plugins.trtllm.model import check_model

    d = executor_driver(deploy)
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
    mc = trtllm_standins.ModelConfig(pretrained_config=pretrained_config(dep))
    with pytest.raises(RuntimeError, match="get_kv_cache_manager_cls is not the OSCAR dispatch in process"):
        ns.modeling_auto.AutoModelForCausalLM.from_config(mc)


def test_startup_check_refuses_a_stock_attention_layer(deploy):
    """Startup check: a model with any layer not on the OSCAR backend raises at construction."""
    ns, dep = deploy
    from oscar_export.plugins.trtllm.model import check_model

    d = executor_driver(deploy)
    check_model(d.model, dep.upstream, dep, dep.attention_cls)  # passes as built
    d.model.layers[1].attn = ns.TrtllmAttention(1, TRTLLM_HEADS, 64, 2)
    with pytest.raises(RuntimeError, match=r"not on the OSCAR backend: \['layers.1 \(TrtllmAttention\)'\]"):
        check_model(d.model, dep.upstream, dep, dep.attention_cls)


def test_startup_check_compares_heads_with_the_family_table(deploy):
    """The backends' (heads, KV heads, head_dim) must be what the family table read from the checkpoint."""
    ns, dep = deploy
    from dataclasses import replace

    from oscar_export.plugins.trtllm.model import check_model

    d = executor_driver(deploy)
    assert (dep.facts.num_heads, dep.facts.num_kv_heads, dep.facts.head_dim) == (TRTLLM_HEADS, 2, 64)
    dep.facts = replace(dep.facts, num_kv_heads=1)
    with pytest.raises(RuntimeError, match=r"are not \(heads, KV heads, head_dim\) \(\d+, 1, 64\) of the checkpoint"):
        check_model(d.model, dep.upstream, dep, dep.attention_cls)
