"""TensorRT-LLM registration of the OSCAR model, cache and the startup check (NOT EXECUTED in TensorRT-LLM).

``register(checkpoint, bundle, module)`` is what the generated ``deploy/trtllm_module/__init__.py`` calls:

1. loads and checks the deployment (``deployment.py``: bad input fails here, before any request);
2. registers ``OscarLlamaForCausalLM`` (the architecture the deployed ``config.json`` names) with
   ``@register_auto_model``: a subclass of upstream's model class that builds every attention layer with the
   OSCAR backend (the stock backend is first built as VANILLA, whose unfused RoPE/QKV contract is the one the
   OSCAR backend shares, then replaced) and ends its constructor with :func:`check_model`;
3. installs the OSCAR cache manager: ``get_kv_cache_manager_cls`` of ``_torch/pyexecutor/_util.py`` is wrapped
   so that for this architecture it returns ``OscarKVCacheManager`` (upstream has no other seam for a cache
   manager class; the wrapper defers to the original for every other model).

The model class's ``__module__`` is the calling module (the deployment's ``trtllm_module``), so TensorRT-LLM's
worker processes, which re-import the module of each registered out-of-tree model, run this registration -- and
the cache-manager installation -- again inside the worker. UNTESTED in TensorRT-LLM: that re-import on the 1.2.1
image (main has ``export_external_model_modules``); the deploy README says so.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .deployment import OscarDeployment


def check_model(model, up, deployment, attention_cls) -> None:
    """Raise unless every attention layer of ``model`` runs the OSCAR backend (one per artifact layer) with the
    heads and head_dim the family table read from the checkpoint (``deployment.facts``)."""
    backends = [(name, m.attn) for name, m in model.named_modules()
                if isinstance(getattr(m, "attn", None), up.AttentionBackend)]
    stock = [f"{name} ({type(b).__name__})" for name, b in backends if not isinstance(b, attention_cls)]
    if stock or len(backends) != deployment.num_layers:
        raise RuntimeError(
            f"OSCAR startup check: {len(backends)} attention layers, {deployment.num_layers} expected, not on the "
            f"OSCAR backend: {stock or 'none'}; refusing to serve a plain BF16 cache"
        )
    f = deployment.facts
    want = (f.num_heads, f.num_kv_heads, f.head_dim)
    wrong = [f"{name} {(b.num_heads, b.num_kv_heads, b.head_dim)}" for name, b in backends
             if (b.num_heads, b.num_kv_heads, b.head_dim) != want]
    if wrong:
        raise RuntimeError(f"OSCAR startup check: attention layers {wrong} are not (heads, KV heads, head_dim) "
                           f"{want} of the checkpoint's family table entry")


def make_model_class(up, deployment, attention_cls):
    arch, module, base = deployment.family
    Base = getattr(importlib.import_module(module), base)

    class OscarModel(Base):
        def __init__(self, model_config, *args, **kwargs):
            try:
                model_config.attn_backend = "VANILLA"  # unfused RoPE + QKV, as the OSCAR backend needs
            except (AttributeError, TypeError):  # a frozen config: the swap below still happens
                pass
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
    """Make ``get_kv_cache_manager_cls`` return ``manager_cls`` for models whose architectures name ``arch``."""
    util = up.executor_util
    original = getattr(util.get_kv_cache_manager_cls, "oscar_original", util.get_kv_cache_manager_cls)

    def get_kv_cache_manager_cls(model_config, *args, **kwargs):
        archs = getattr(getattr(model_config, "pretrained_config", None), "architectures", None) or []
        if arch in archs:
            return manager_cls
        return original(model_config, *args, **kwargs)

    get_kv_cache_manager_cls.oscar_original = original
    util.get_kv_cache_manager_cls = get_kv_cache_manager_cls


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
        dep.model_cls.__module__ = module
        if module in sys.modules:
            setattr(sys.modules[module], name, dep.model_cls)
    up.register_auto_model(name)(dep.model_cls)
    install_cache_manager(up, name, dep.manager_cls)
    return dep


__all__ = ["check_model", "install_cache_manager", "make_model_class", "register"]
