"""TensorRT-LLM (PyTorch backend) host for the OSCAR cache, loaded by ``trtllm-serve --custom_module_dirs``.

NOT EXECUTED in TensorRT-LLM: it cannot be installed on the machines this project was built on. The files:

* ``deployment.py`` -- the deployment and its startup checks (bad checkpoint/bundle/family/limits);
* ``model.py`` -- ``register()``: the out-of-tree model (``@register_auto_model``), the cache-manager
  installation and the startup check that every attention layer runs the OSCAR backend;
* ``attention.py`` / ``cache.py`` -- the ``AttentionBackend`` and ``KVCacheManager`` subclasses (pages, lengths
  and the step: ``kernels/pages.py``'s ``PageBook``, its rows the C++ block ids);
* ``device.py`` / ``reference_ops.py`` -- the cache operations through the AOT bundle (GPU) / the reference;
* ``upstream.py`` -- where TensorRT-LLM keeps those names (1.2 and main layouts).

Tested against stand-ins of the upstream classes under their real module names, written from upstream's source
on the paths that decide whether serving starts (``from_config``'s frozen config, ``Attention.__init__`` /
``forward``, ``KvCacheCreator``'s estimation and rebuild, a worker in a spawned process: tests/plugins/
test_trtllm_*.py); the deployment's wheel installed into a fresh virtualenv (tests/plugins/
test_trtllm_deploy.py); the device ops on an H200 (tests/gpu/test_trtllm_gpu.py). docs/deploy.md lists each
upstream fact with its file and commit, and what is unverified.
"""


def register(checkpoint, bundle, module=None, arch=None, ops_factory=None):
    """Register the OSCAR model and cache with TensorRT-LLM for one deployment (see ``model.py``)."""
    from .model import register as _register

    return _register(checkpoint, bundle, module=module, arch=arch, ops_factory=ops_factory)


__all__ = ["register"]
