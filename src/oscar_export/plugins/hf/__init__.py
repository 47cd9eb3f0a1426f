"""Hugging Face transformers host: the OSCAR paged INT2 cache as a ``Cache`` plus an ``"oscar"`` attention.

Usage::

    from oscar_export.plugins.hf import enable_oscar

    oscar = enable_oscar(model)                       # or enable_oscar(model, artifact="artifact_dir")
    cache = oscar.make_cache(batch_size=1, max_length=4096)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)
    oscar.restore()                                   # back to the model's previous attention

Files: ``support.py`` (model checks, ``enable_oscar``), ``cache.py`` (``OscarCache``: its layers, one page book),
``oscar_layer.py`` (``OscarLayer``: one layer's windows and pools), ``attention.py`` (the attention and mask
functions), ``ops.py`` (the backend seam).
"""

from .cache import OscarCache
from .cache_layer import LayerStep
from .ops import BACKENDS, CacheOps, get_ops
from .oscar_layer import OscarLayer
from .support import (
    SUPPORTED_MODEL_TYPES,
    OscarSetup,
    cache_kwargs,
    enable_oscar,
    register_attention,
)

__all__ = [
    "BACKENDS",
    "SUPPORTED_MODEL_TYPES",
    "CacheOps",
    "LayerStep",
    "OscarCache",
    "OscarLayer",
    "OscarSetup",
    "cache_kwargs",
    "enable_oscar",
    "get_ops",
    "register_attention",
]
