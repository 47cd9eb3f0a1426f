"""An OSCAR attention backend for TensorRT-LLM's AutoDeploy (``trtllm-serve --backend _autodeploy``): NOT EXECUTED
in TensorRT-LLM, which cannot be installed on the machines this project was built on.

AutoDeploy exports the Hugging Face model with ``torch.export``, and its ``insert_cached_attention`` transform
replaces each attention node with the cached-attention op of the backend named in its config, from a public
registry (``custom_ops/attention_interface.py`` ``AttentionRegistry``). The files, each written against that
interface at TensorRT-LLM commit 086f0cea (docs/deploy.md, "AutoDeploy"):

* ``descriptor.py`` -- the ``AttentionDescriptor`` registered as ``"oscar"``: source op, cached op, metadata,
  cache resources and constants of each attention node;
* ``resources.py`` -- the OSCAR pools of one layer as resource handlers (per-slot BF16 windows, per-page INT2
  pools, the non-finite flag), allocated by AutoDeploy itself;
* ``metadata.py`` -- the ``prepare_metadata`` op: the cache's lengths from ``input_pos`` / ``seq_len``, and the
  block table from ``cache_loc``;
* ``cached_attention.py`` -- the cached-attention op (prompt writes and the decode step through the deployment's
  cache ops: the AOT bundle on the GPU, the PyTorch reference elsewhere);
* ``binding.py`` -- how the op reaches a deployment's per-layer transforms and cache ops.

Tested on the CPU against stand-ins of that interface (tests/plugins/test_autodeploy.py,
tests/plugins/autodeploy_standins.py).
"""

from __future__ import annotations


def register(deployment, attention_interface=None, ops_factory=None, binding: str = "oscar"):
    """Register the ``"oscar"`` backend for ``deployment`` (an ``OscarDeployment``) and return its descriptor class.

    Args:
        attention_interface: the module holding ``AttentionDescriptor``, ``AttentionRegistry`` and the resource
            handlers; default TensorRT-LLM's ``tensorrt_llm._torch.auto_deploy.custom_ops.attention_interface``.
        ops_factory: ``ops_factory(layout)`` gives the cache ops of one layer layout (default
            ``deployment.ops``: the bundle's kernels, GPU only).
        binding: the key the cached op finds the deployment under (``binding.py``).
    """
    from .binding import bind
    from .descriptor import BACKEND_NAME, make_descriptor_class

    up = attention_interface
    if up is None:
        try:
            from tensorrt_llm._torch.auto_deploy.custom_ops import attention_interface as up
        except ImportError as e:
            raise ImportError("the OSCAR AutoDeploy backend needs TensorRT-LLM (run it in a TensorRT-LLM image)") from e
    if up.AttentionRegistry.has(BACKEND_NAME):
        raise ValueError(f"an AutoDeploy attention backend {BACKEND_NAME!r} is already registered in this process")
    bind(binding, deployment, ops_factory)
    return up.AttentionRegistry.register(BACKEND_NAME)(make_descriptor_class(up, binding))


__all__ = ["register"]
