"""The OSCAR ``AttentionDescriptor``, registered with AutoDeploy's ``AttentionRegistry`` under one name, ``"oscar"``.

Written against TensorRT-LLM's ``_torch/auto_deploy/custom_ops/attention_interface.py`` @086f0cea (the class and
its classmethods), read with ``custom_ops/attention/torch_backend_attention.py`` @086f0cea (the stock backend on the
same source op) and the ``transform/library/kvcache.py`` copy that calls ``get_cache_initializers(attn_node,
cm.kv_cache_config)`` and ``cm.add_resource`` (the index names no commit for it). The ``insert_cached_attention``
transform finds every node of :meth:`get_source_attention_op` in the exported graph, adds the standard metadata
(:meth:`get_standard_metadata_args`, by ``SequenceInfo`` name) and the cache resources of each node as graph
inputs, inserts :meth:`get_prepare_extra_metadata_info`'s op once, and replaces each node with
``get_cached_attention_op()(*qkv, *metadata, *extra metadata, *caches, *get_constants(node))``.

The source op is AutoDeploy's ``auto_deploy::torch_attention`` in the ``bsnd`` layout (the stock ``"torch"``
backend's): post-RoPE ``q, k, v`` of the exported model. The layer of a node is its rank among the graph's
attention nodes (source or already replaced, in graph order: the transform replaces them in that order), which is
the artifact's layer index for a decoder whose attention layers run in order.
"""

from __future__ import annotations

import math

import torch

from .binding import bound
from .metadata import NUM_METADATA
from .resources import cache_resources

#: the one name the backend is registered under (``insert_cached_attention: backend: oscar``)
BACKEND_NAME = "oscar"
#: ``SequenceInfo`` arguments the cached op takes, in its signature's order
STANDARD_METADATA = ("batch_info_host", "seq_len", "input_pos", "slot_idx", "cu_seqlen", "cache_loc", "cu_num_pages",
                     "max_seq_info_host")


def _calls(node, packet) -> bool:
    return node.op == "call_function" and (node.target is packet or getattr(node.target, "overloadpacket", None)
                                           is packet)


def layer_of(node) -> int:
    """Rank of ``node`` among the graph's source and OSCAR cached attention nodes (graph order)."""
    src, cached = torch.ops.auto_deploy.torch_attention, torch.ops.oscar_ad.cached_attention
    rank = 0
    for n in node.graph.nodes:
        if n is node:
            return rank
        rank += _calls(n, src) or _calls(n, cached)
    raise ValueError(f"{node}: not in its graph")


def make_descriptor_class(up, binding: str):
    """``OscarAttention(up.AttentionDescriptor)`` serving the deployment bound under ``binding`` (``binding.py``);
    ``up`` is the interface module (``tensorrt_llm._torch.auto_deploy.custom_ops.attention_interface``)."""
    from . import cached_attention, metadata  # noqa: F401  (registers the oscar_ad ops)

    class OscarAttention(up.AttentionDescriptor):
        @classmethod
        def get_attention_layout(cls) -> str:
            return "bsnd"

        @classmethod
        def get_num_qkv_args(cls) -> int:
            return 3

        @classmethod
        def get_source_attention_op(cls):
            return torch.ops.auto_deploy.torch_attention

        @classmethod
        def get_cached_attention_op(cls):
            return torch.ops.oscar_ad.cached_attention.default

        @classmethod
        def get_standard_metadata_args(cls) -> list[str]:
            return list(STANDARD_METADATA)

        @classmethod
        def get_prepare_extra_metadata_info(cls, any_source_attn_node):
            lay = bound(binding).deployment.layout  # windows and page size: the same in every layer
            return (torch.ops.oscar_ad.prepare_metadata.default, NUM_METADATA,
                    [lay.sink, lay.recent_capacity, lay.page_size])

        @classmethod
        def get_cache_initializers(cls, source_attn_node, cache_config) -> dict:
            dep = bound(binding).deployment
            layer = cls.check_node(source_attn_node)
            return cache_resources(up, dep.layer_layouts[layer])

        @classmethod
        def get_constants(cls, source_attn_node) -> list:
            return [binding, cls.check_node(source_attn_node), float(bound(binding).deployment.sm_scale)]

        @classmethod
        def check_node(cls, node) -> int:
            """The node's layer, after checking its shapes and softmax scale against the deployment (one line)."""
            dep = bound(binding).deployment
            layer = layer_of(node)
            if layer >= dep.num_layers:
                raise ValueError(f"attention node {layer}: the OSCAR artifact has {dep.num_layers} layers")
            lay = dep.layer_layouts[layer]
            q, k = (node.args[i].meta["val"] for i in (0, 1))
            if tuple(k.shape[2:]) != (lay.num_kv_heads, lay.head_dim) or q.shape[2] != dep.num_heads:
                raise ValueError(f"attention node {layer}: q {list(q.shape)}, k {list(k.shape)} (bsnd); the OSCAR "
                                 f"deployment has {dep.num_heads} heads, {lay.num_kv_heads} KV heads x {lay.head_dim}")
            scale = _source_scale(node)
            want = dep.sm_scale
            if not math.isclose(scale if scale is not None else lay.head_dim ** -0.5, want, rel_tol=1e-6):
                raise ValueError(f"attention node {layer}: softmax scale {scale}; the OSCAR deployment's is {want}")
            return layer

    OscarAttention.__qualname__ = OscarAttention.__name__
    return OscarAttention


def _source_scale(node):
    """The ``scale`` of a ``torch_attention`` node (7th positional argument or keyword), None when unset."""
    if len(node.args) > 6:
        return node.args[6]
    return node.kwargs.get("scale")


__all__ = ["BACKEND_NAME", "STANDARD_METADATA", "layer_of", "make_descriptor_class"]
