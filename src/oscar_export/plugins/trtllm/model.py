"""TensorRT-LLM registration of the OSCAR model, cache and the startup checks (NOT EXECUTED in TensorRT-LLM).

``register(checkpoint, bundle, module)`` is what the generated ``deploy/trtllm_module/__init__.py`` calls:

1. loads and checks the deployment (``deployment.py``: bad input fails here, before any request);
2. registers ``OscarLlamaForCausalLM`` (the architecture the deployed ``config.json`` names) with
   ``@register_auto_model``: a subclass of upstream's model class (see :func:`make_model_class`);
3. installs the OSCAR cache manager: ``get_kv_cache_manager_cls`` of ``_torch/pyexecutor/_util.py`` is replaced
   by a dispatch that returns ``OscarKVCacheManager`` for this architecture and defers to the original for every
   other model. Upstream has no supported seam for a cache-manager class (the dispatch is a fixed if-chain,
   ``extra_resource_managers`` cannot replace the KV manager), so this patches a private function; the patch is
   checked where it must have taken: right after it is made, and again in the model constructor, in whichever
   process builds the model (:func:`check_cache_manager_installed`).

How the layers get the OSCAR backend: upstream builds the model with ``AutoModelForCausalLM.from_config``,
which freezes ``ModelConfig`` first; ``Attention.__init__`` then decides ``rope_fusion`` (from the configured
backend class's ``support_fused_rope()``), whether ``rotary_emb`` exists and ``support_fused_qkv`` once, from
``config.attn_backend`` (TRTLLM: both fused). The model constructor therefore sets ``attn_backend = "VANILLA"``
(unfused RoPE and QKV, the contract the OSCAR backend shares) through the bypass ``ModelConfig``'s docstring
names (``_frozen = False`` for the assignment), builds the layers, puts the configured backend name back (the
executor reads it afterwards: e.g. ``KvCacheCreator`` skips the KV-cache estimation for VANILLA), replaces each
layer's ``.attn`` with the OSCAR backend and ends with :func:`check_model`, which asserts per layer the class
and the wiring (``rope_fusion`` False, a ``rotary_emb``, ``support_fused_qkv`` False).

The model class's ``__module__`` is the calling module (the deployment's ``trtllm_module``): TensorRT-LLM sends
``MODEL_CLASS_MAPPING`` pickled to its executor worker (``executor/proxy.py``), whose unpickling imports that
module by name, running this registration -- and the cache-manager installation -- again inside the worker.
The worker finds the module on ``sys.path``: ``MpiPoolSession`` starts workers with the driver's ``sys.path``
(``llmapi/mpi_session.py``); pre-spawned workers (``TLLM_SPAWN_PROXY_PROCESS=1``) do not get it, so
:func:`check_worker_path` refuses that case unless the module's directory is on ``PYTHONPATH``.
UNTESTED in TensorRT-LLM: all of it ran against stand-ins of the upstream classes only
(tests/plugins/test_trtllm_model.py, the worker in a separate spawned process).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

from .deployment import OscarDeployment

#: the attention backend the layers are constructed with: RoPE and QKV unfused, as the OSCAR backend takes them
CONSTRUCTION_BACKEND = "VANILLA"


def _set_config(model_config, key: str, value) -> None:
    """``model_config.key = value``, through ``ModelConfig``'s documented bypass when it is frozen."""
    frozen = bool(getattr(model_config, "_frozen", False))
    if frozen:
        model_config._frozen = False
    try:
        setattr(model_config, key, value)
    finally:
        if frozen:
            model_config._frozen = True


@contextlib.contextmanager
def constructed_with(model_config, backend: str):
    """``model_config.attn_backend`` is ``backend`` inside the block, the configured one again after it."""
    configured = model_config.attn_backend
    _set_config(model_config, "attn_backend", backend)
    try:
        yield
    finally:
        _set_config(model_config, "attn_backend", configured)


def check_model(model, up, deployment, attention_cls) -> None:
    """Raise unless every attention layer of ``model`` runs the OSCAR backend (one per artifact layer), is wired
    for it (RoPE applied by the layer, q/k/v split: ``rope_fusion`` False, a ``rotary_emb``, ``support_fused_qkv``
    False) and has the heads and head_dim the family table read from the checkpoint (``deployment.facts``)."""
    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(getattr(m, "attn", None), up.AttentionBackend)]
    stock = [f"{name} ({type(m.attn).__name__})" for name, m in layers if not isinstance(m.attn, attention_cls)]
    if stock or len(layers) != deployment.num_layers:
        raise RuntimeError(
            f"OSCAR startup check: {len(layers)} attention layers, {deployment.num_layers} expected, not on the "
            f"OSCAR backend: {stock or 'none'}; refusing to serve a plain BF16 cache"
        )
    if attention_cls.support_fused_rope() or attention_cls.support_fused_qkv():
        raise RuntimeError("OSCAR startup check: the OSCAR backend class reports fused RoPE or QKV")
    want = {"rope_fusion": False, "support_fused_qkv": False, "rotary_emb": True}
    wired = []
    for name, m in layers:
        have = {"rope_fusion": getattr(m, "rope_fusion", "missing"),
                "support_fused_qkv": getattr(m, "support_fused_qkv", "missing"),
                "rotary_emb": getattr(m, "rotary_emb", None) is not None}
        wired += [f"{name}.{k} = {have[k]}" for k in want if have[k] != want[k]]
    if wired:
        raise RuntimeError(f"OSCAR startup check: attention layers wired for a fused backend ({', '.join(wired)}): "
                           "the OSCAR backend needs RoPE applied by the layer and q, k, v split; refusing to serve")
    f = deployment.facts
    want_shape = (f.num_heads, f.num_kv_heads, f.head_dim)
    wrong = [f"{name} {(m.attn.num_heads, m.attn.num_kv_heads, m.attn.head_dim)}" for name, m in layers
             if (m.attn.num_heads, m.attn.num_kv_heads, m.attn.head_dim) != want_shape]
    if wrong:
        raise RuntimeError(f"OSCAR startup check: attention layers {wrong} are not (heads, KV heads, head_dim) "
                           f"{want_shape} of the checkpoint's family table entry")


def check_cache_manager_installed(up, arch: str, manager_cls) -> None:
    """Raise unless ``_util.get_kv_cache_manager_cls`` in this process returns ``manager_cls`` for ``arch``."""
    util = up.executor_util
    fn = util.get_kv_cache_manager_cls
    if getattr(fn, "oscar_manager", None) is not manager_cls:
        raise RuntimeError(
            f"OSCAR startup check: {util.__name__}.get_kv_cache_manager_cls is not the OSCAR dispatch in process "
            f"{os.getpid()} (the deployment's trtllm_module was not imported here); refusing to serve a plain BF16 "
            "cache")


def make_model_class(up, deployment, attention_cls):
    arch, module, base = deployment.family
    Base = getattr(importlib.import_module(module), base)

    class OscarModel(Base):
        def __init__(self, model_config, *args, **kwargs):
            check_cache_manager_installed(up, arch, deployment.manager_cls)
            with constructed_with(model_config, CONSTRUCTION_BACKEND):
                super().__init__(model_config, *args, **kwargs)
            for _, m in self.named_modules():
                b = getattr(m, "attn", None)
                if isinstance(b, up.AttentionBackend) and not isinstance(b, attention_cls):
                    m.attn = attention_cls(b.layer_idx, b.num_heads, b.head_dim, b.num_kv_heads,
                                           getattr(b, "quant_config", None), q_scaling=getattr(m, "q_scaling", 1.0))
            check_model(self, up, deployment, attention_cls)

    OscarModel.__name__ = OscarModel.__qualname__ = arch
    return OscarModel


def install_cache_manager(up, arch: str, manager_cls) -> None:
    """Make ``get_kv_cache_manager_cls`` return ``manager_cls`` for models whose architectures name ``arch``;
    raise unless a call through the module's name then returns it."""
    util = up.executor_util
    original = getattr(util.get_kv_cache_manager_cls, "oscar_original", util.get_kv_cache_manager_cls)

    def get_kv_cache_manager_cls(model_config, *args, **kwargs):
        archs = getattr(getattr(model_config, "pretrained_config", None), "architectures", None) or []
        if arch in archs:
            return manager_cls
        return original(model_config, *args, **kwargs)

    get_kv_cache_manager_cls.oscar_original = original
    get_kv_cache_manager_cls.oscar_manager = manager_cls
    util.get_kv_cache_manager_cls = get_kv_cache_manager_cls
    probe = type("ModelConfig", (), {"pretrained_config": type("Config", (), {"architectures": [arch]})()})()
    if util.get_kv_cache_manager_cls(probe, None) is not manager_cls:
        raise RuntimeError(f"OSCAR startup check: {util.__name__}.get_kv_cache_manager_cls could not be replaced")


def check_worker_path(module: str) -> None:
    """Raise when the executor workers are pre-spawned (``TLLM_SPAWN_PROXY_PROCESS=1``: they do not get this
    process's ``sys.path``) and the directory holding ``module`` is not on ``PYTHONPATH``."""
    if os.environ.get("TLLM_SPAWN_PROXY_PROCESS") != "1" or module not in sys.modules:
        return
    mod = sys.modules[module]
    if not getattr(mod, "__file__", None):
        return
    where = Path(mod.__file__).resolve().parent
    if hasattr(mod, "__path__"):  # a package: its parent directory is what must be on the path
        where = where.parent
    on_path = {Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if where not in on_path:
        raise RuntimeError(
            f"OSCAR startup check: the MPI workers are pre-spawned (TLLM_SPAWN_PROXY_PROCESS=1) and do not receive "
            f"this process's sys.path, so they cannot import {module!r}: add {where} to PYTHONPATH")


def register(checkpoint: str | Path, bundle: str | Path, module: str | None = None, arch: str | None = None,
             ops_factory=None):
    """Register the OSCAR model and cache for one deployment (see the module doc); returns the deployment
    with ``model_cls``, ``attention_cls`` and ``manager_cls`` attached. ``ops_factory(layout)`` gives the cache
    ops of one layer layout; it defaults to the AOT bundle's (``device.AotCacheOps``); tests pass the reference
    ops."""
    from .attention import make_attention_class
    from .cache import make_cache_manager_class
    from .upstream import resolve

    up = resolve()
    dep = OscarDeployment(checkpoint, bundle, arch)
    dep.upstream = up
    dep.attention_cls = make_attention_class(up, dep)
    dep.manager_cls = make_cache_manager_class(up, dep, ops_factory or dep.ops)
    dep.model_cls = make_model_class(up, dep, dep.attention_cls)
    name = dep.family[0]
    if module is not None:
        check_worker_path(module)
        dep.model_cls.__module__ = module
        if module in sys.modules:
            setattr(sys.modules[module], name, dep.model_cls)
    up.register_auto_model(name)(dep.model_cls)
    install_cache_manager(up, name, dep.manager_cls)
    return dep


__all__ = ["CONSTRUCTION_BACKEND", "check_cache_manager_installed", "check_model", "check_worker_path",
           "constructed_with", "install_cache_manager", "make_model_class", "register"]
