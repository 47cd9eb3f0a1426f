"""TensorRT-LLM (PyTorch backend) host for the OSCAR cache, loaded by ``trtllm-serve --custom_module_dirs``.

NOT EXECUTED here: TensorRT-LLM cannot be installed on the machines this project was built on. The
plain-Python bookkeeping (``bookkeeping.py``: page pool, demotion schedule, block tables, shape rules) is
tested; the TensorRT-LLM-facing classes (``module.py``) import TensorRT-LLM lazily and raise an
``ImportError`` naming what to install when it is missing.
"""

from .bookkeeping import Demotion, OscarCacheBook, PagePool, PoolExhausted, pages_per_seq_for, pool_pages_for


def register(checkpoint, bundle):
    """Register the OSCAR cache with TensorRT-LLM for one deployment (see ``module.py``)."""
    from .module import register as _register

    return _register(checkpoint, bundle)


__all__ = ["Demotion", "OscarCacheBook", "PagePool", "PoolExhausted", "pages_per_seq_for", "pool_pages_for", "register"]
