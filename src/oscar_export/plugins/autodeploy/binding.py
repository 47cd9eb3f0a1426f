"""What the cached-attention op needs besides tensors: a deployment's per-layer transforms and cache ops.

A ``torch.library`` custom op takes tensors and scalars only, and AutoDeploy passes a backend's per-layer extras as
constants of those types (``AttentionDescriptor.get_constants`` @086f0cea: "int, float, str, or None"). The
rotations, scales, means and code levels of a layer (``LayerTransform``) and the cache ops (the AOT bundle's
kernels on the GPU, ``AotCacheOps``; the PyTorch reference, ``TorchCacheOps``) are therefore reached through the
op's ``binding`` (a str constant) and ``layer`` (an int constant): :func:`bind` records a deployment under a key
when the backend is registered, :func:`bound` finds it when the op runs. The table is process-wide, like
upstream's ``AttentionRegistry`` it sits beside: a process serves the deployments it bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Binding:
    """One deployment as the op sees it.

    Args:
        deployment: an ``OscarDeployment`` (``plugins/trtllm/deployment.py``): ``layer_layouts``, ``num_heads``,
            ``sm_scale``, ``transform(layer, device)``.
        ops: the cache ops of each layer (``write_planned``, ``chunk_attention``, ``decode_step``, ``decode``).
    """

    deployment: Any
    ops: tuple

    def transform(self, layer: int, device):
        return self.deployment.transform(layer, device)


_BOUND: dict[str, Binding] = {}


def bind(key: str, deployment, ops_factory: Callable | None = None) -> Binding:
    """Record ``deployment`` under ``key`` with ``ops_factory(layout)`` (default ``deployment.ops``: the bundle's
    kernels) made once per distinct layer layout. Rebinding a key replaces it."""
    factory = ops_factory or deployment.ops
    by_layout = {lay: factory(lay) for lay in dict.fromkeys(deployment.layer_layouts)}
    _BOUND[key] = Binding(deployment, tuple(by_layout[lay] for lay in deployment.layer_layouts))
    return _BOUND[key]


def bound(key: str) -> Binding:
    if key not in _BOUND:
        raise KeyError(f"OSCAR AutoDeploy binding {key!r} is not registered in this process (registered: "
                       f"{sorted(_BOUND)}); call oscar_export.plugins.autodeploy.register before building the model")
    return _BOUND[key]


__all__ = ["Binding", "bind", "bound"]
