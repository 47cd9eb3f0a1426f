"""Stand-ins of TensorRT-LLM's AutoDeploy attention interface, for the OSCAR backend's tests (tests/plugins/
test_autodeploy.py). Written from upstream's source (NVIDIA/TensorRT-LLM) read through this project's source index;
nothing here is upstream's code.

Each stand-in, the upstream file (and commit) it reproduces, and what of it:

* ``ResourceHandler``, ``StateResourceHandler``, ``KVPagedResourceHandler`` --
  ``tensorrt_llm/_torch/auto_deploy/custom_ops/attention_interface.py`` @086f0cea: ``is_paged`` (False unless
  overridden), ``bytes_per_token`` (paged only), abstract ``allocate(sequence_info)``; a state resource is
  ``torch.empty(max_num_state_slots, *state_shape)``; equality by type, shape and dtype.
* ``AttentionDescriptor``, ``AttentionRegistry`` -- same file @086f0cea: the abstract classmethods, the defaults of
  ``get_prepare_extra_metadata_info`` (``None, 0, []``) and ``get_constants`` (``[]``); ``register(name)`` asserts
  a new name; ``get`` / ``has``.
* ``SequenceInfo`` -- same file @086f0cea: ``(max_seq_len, max_batch_size, tokens_per_block, max_num_tokens)``,
  ``max_num_state_slots = max_batch_size + 1``, ``max_blocks_per_seq = ceil(max_seq_len / tokens_per_block)``;
  device buffers of fixed capacity, written from the front and never cleared behind (rows past the batch keep
  older values); ``batch_info = [num_prefill, num_prefill_tokens, num_decode]``, prefill = ``seq_len > 1`` when
  not given; ``cu_seqlen`` and ``cu_num_pages`` from the lengths; ``update_cache_information(num_blocks)`` writes
  ``max_seq_info = [max_seq_len, max_blocks_per_seq, 0, max_batch_size]``; every name also as ``<name>_host``;
  graph inputs only for activated names.
* ``CachedSequenceInterface`` -- ``tensorrt_llm/_torch/auto_deploy/shim/interface.py`` (the index names no commit;
  the copy with ``add_resource(name, handler)`` and ``_allocate_unmanaged_resources``): handlers other than
  ``KVPagedResourceHandler`` / SSM / conv are allocated by ``handler.allocate(info)``; with no KV handler the
  placeholder ``KVCacheManager``'s blocks set ``num_blocks`` (here: given); ``named_args = {**info, **caches}``.
* ``insert_cached_attention`` -- ``tensorrt_llm/_torch/auto_deploy/transform/library/kvcache.py`` (the index names
  no commit; the copy with ``_InsertCachedOperator``): source nodes by ``get_source_attention_op``; the standard
  metadata as graph inputs by name; the ``prepare_metadata`` op once, after the last placeholder, its inputs the
  schema's argument names ``SequenceInfo`` has, then its constants; per node ``get_cache_initializers(node,
  kv_cache_config)`` as ``{name}_{idx}`` graph inputs and ``get_constants(node)``; the cached node ``(*qkv,
  *meta_std, *meta_extra, *caches, *constants)`` inserted before the source node, which is erased.
* ``auto_deploy::torch_attention`` -- ``tensorrt_llm/_torch/auto_deploy/custom_ops/attention/torch_attention.py``
  (the index names no commit): the source op's signature ``(query, key, value, attn_mask, dropout_p, is_causal,
  scale, sinks, sliding_window, logit_cap, layout)``; here only causal SDPA without mask, sinks, window or cap.

Not reproduced: ``BaseTransform._add_or_retrieve_input`` / ``add_graph_input`` were not read (a placeholder of the
argument's name is added), the executor (``shim/ad_executor.py``: how requests become ``nest_sequences`` calls,
padding, CUDA graphs), export itself (here ``torch.fx.symbolic_trace`` + ``FakeTensorProp`` give the source nodes
their ``meta["val"]``), the cache resize.
"""

from __future__ import annotations

import math
import operator
import types
from abc import ABC, abstractmethod

import torch

# ---- the source op (custom_ops/attention/torch_attention.py) ----------------------------------------------------


@torch.library.custom_op("auto_deploy::torch_attention", mutates_args=())
def torch_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    sinks: torch.Tensor | None = None, sliding_window: int | None = None,
                    logit_cap: float | None = None, layout: str = "bnsd") -> torch.Tensor:
    assert attn_mask is None and sinks is None and sliding_window is None and logit_cap is None
    tr = (lambda x: x.transpose(1, 2)) if layout == "bsnd" else (lambda x: x)  # noqa: E731
    o = torch.nn.functional.scaled_dot_product_attention(tr(query), tr(key), tr(value), dropout_p=dropout_p,
                                                         is_causal=is_causal, scale=scale, enable_gqa=True)
    return tr(o).contiguous()


@torch_attention.register_fake
def _torch_attention_fake(query, key, value, *args, **kwargs):
    return torch.empty_like(query)


# ---- the interface module (custom_ops/attention_interface.py @086f0cea) ------------------------------------------


def attention_interface() -> types.SimpleNamespace:
    """A fresh stand-in of the interface module (its own ``AttentionRegistry``)."""

    class ResourceHandler(ABC):
        @property
        def is_paged(self) -> bool:
            return False

        @property
        def bytes_per_token(self) -> int:
            if self.is_paged:
                return self._get_bytes_per_token()
            raise NotImplementedError(f"Resource {self.__class__.__name__} is not paged.")

        def _get_bytes_per_token(self) -> int:
            raise NotImplementedError

        @abstractmethod
        def allocate(self, sequence_info) -> torch.Tensor: ...

    class KVPagedResourceHandler(ResourceHandler):
        """Only its type matters here: the interface gives these the C++ manager's pool."""

        @property
        def is_paged(self) -> bool:
            return True

        def allocate(self, sequence_info):
            raise NotImplementedError("the stand-in interface has no C++ KVCacheManager")

    class StateResourceHandler(ResourceHandler):
        def __init__(self, *state_shape: int, dtype: torch.dtype) -> None:
            self._state_shape, self.dtype = state_shape, dtype

        @property
        def state_shape(self):
            return self._state_shape

        def allocate(self, sequence_info) -> torch.Tensor:
            return torch.empty(sequence_info.max_num_state_slots, *self.state_shape, device=sequence_info.device,
                               dtype=self.dtype)

        def __eq__(self, other) -> bool:
            return type(other) is type(self) and self.state_shape == other.state_shape and self.dtype == other.dtype

    class AttentionDescriptor(ABC):
        @classmethod
        @abstractmethod
        def get_attention_layout(cls): ...

        @classmethod
        @abstractmethod
        def get_num_qkv_args(cls) -> int: ...

        @classmethod
        @abstractmethod
        def get_source_attention_op(cls): ...

        @classmethod
        @abstractmethod
        def get_cached_attention_op(cls): ...

        @classmethod
        @abstractmethod
        def get_standard_metadata_args(cls) -> list: ...

        @classmethod
        def get_prepare_extra_metadata_info(cls, any_source_attn_node):
            return None, 0, []

        @classmethod
        @abstractmethod
        def get_cache_initializers(cls, source_attn_node, cache_config) -> dict: ...

        @classmethod
        def get_constants(cls, source_attn_node) -> list:
            return []

        @classmethod
        def get_host_prepare_metadata_function(cls):
            return None

    class AttentionRegistry:
        _attention_registry: dict = {}

        @classmethod
        def register(cls, kernel_source: str):
            def decorator(attention_cls):
                assert kernel_source not in cls._attention_registry, (
                    f"Attention source {kernel_source} already registered.")
                cls._attention_registry[kernel_source] = attention_cls
                return attention_cls

            return decorator

        @classmethod
        def get(cls, kernel_source: str):
            assert cls.has(kernel_source), f"Attention source {kernel_source} not registered."
            return cls._attention_registry[kernel_source]

        @classmethod
        def has(cls, kernel_source: str) -> bool:
            return kernel_source in cls._attention_registry

    return types.SimpleNamespace(**{c.__name__: c for c in (
        ResourceHandler, KVPagedResourceHandler, StateResourceHandler, AttentionDescriptor, AttentionRegistry)},
        SequenceInfo=SequenceInfo)


class SequenceInfo:
    """Per-step sequence metadata in fixed-capacity device buffers (see the module doc)."""

    def __init__(self, max_seq_len: int, max_batch_size: int, tokens_per_block: int | None = None,
                 max_num_tokens: int | None = None, device="cpu") -> None:
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        self.tokens_per_block = tokens_per_block or max_seq_len
        self.max_blocks_per_seq = math.ceil(max_seq_len / self.tokens_per_block)
        self.max_num_tokens = max_num_tokens or (max_seq_len + 1) * max_batch_size
        self.max_num_state_slots = max_batch_size + 1
        self.device = torch.device(device)
        self._num_blocks = None
        b, t = max_batch_size, self.max_num_tokens
        specs = {"input_ids": (t, torch.int), "position_ids": (t, torch.long), "seq_len": (b, torch.int),
                 "cu_seqlen": (b + 1, torch.int), "input_pos": (b, torch.int), "pages_per_seq": (b, torch.int),
                 "cu_num_pages": (b + 1, torch.int), "slot_idx": (b, torch.long), "batch_info": (3, torch.int),
                 "max_seq_info": (4, torch.int), "cache_loc": (t, torch.int)}
        self._buf = {k: torch.zeros(n, dtype=dt, device=self.device) for k, (n, dt) in specs.items()}
        self._host = {k: torch.zeros(n, dtype=dt) for k, (n, dt) in specs.items()}
        self.available_args = set(specs) | {f"{k}_host" for k in specs}
        self._active_args = ["input_ids"]
        self._shape = (1, 1)

    @property
    def num_blocks(self) -> int:
        assert self._num_blocks is not None, "num_blocks not set yet"
        return self._num_blocks

    def update_cache_information(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._store("max_seq_info", [self.max_seq_len, self.max_blocks_per_seq, 0, self.max_batch_size])
        if num_blocks * min(10, self.max_batch_size) + 1 > self._buf["cache_loc"].numel():
            n = num_blocks * min(10, self.max_batch_size) + 1
            self._buf["cache_loc"] = torch.zeros(n, dtype=torch.int, device=self.device)
            self._host["cache_loc"] = torch.zeros(n, dtype=torch.int)

    def activate_arg(self, name: str) -> None:
        assert name in self.available_args, f"{name=} not found in {self.available_args}"
        if name not in self._active_args:
            self._active_args.append(name)

    def _store(self, name: str, values) -> None:
        vals = torch.as_tensor(values, dtype=self._buf[name].dtype).flatten()
        self._host[name][: vals.numel()] = vals  # the rest keeps what an earlier step wrote
        self._buf[name][: vals.numel()] = vals.to(self.device)

    def nest_sequences(self, input_ids, input_pos, cache_loc, pages_per_seq, slot_idx, batch_info=None) -> None:
        """``input_ids``: one list of tokens per sequence (prefill rows first)."""
        seq_len = [len(ids) for ids in input_ids]
        self._store("seq_len", seq_len)
        self._store("input_pos", input_pos)
        flat = [i for ids in input_ids for i in ids]
        self._store("input_ids", flat)
        self._store("position_ids", [p + j for p, n in zip(input_pos, seq_len) for j in range(n)])
        if batch_info is None:
            pre = [n for n in seq_len if n > 1]
            batch_info = [len(pre), sum(pre), len(seq_len) - len(pre)]
        self._store("batch_info", batch_info)
        self._store("cu_seqlen", [0, *torch.tensor(seq_len).cumsum(0).tolist()])
        self._store("cache_loc", cache_loc)
        self._store("pages_per_seq", pages_per_seq)
        self._store("cu_num_pages", [0, *torch.tensor(pages_per_seq).cumsum(0).tolist()])
        self._store("slot_idx", slot_idx)
        generate = all(n == 1 for n in seq_len)
        self._shape = (len(seq_len), 1) if generate else (1, len(flat))

    def get_arg(self, name: str) -> torch.Tensor:
        if name.endswith("_host"):
            return self._host[name.removesuffix("_host")]
        if name == "input_ids":
            return self._buf[name][: self._shape[0] * self._shape[1]].view(*self._shape)
        return self._buf[name]

    @property
    def named_args(self) -> dict:
        return {k: self.get_arg(k) for k in self._active_args}


class CachedSequenceInterface:
    """``SequenceInfo`` plus the resources the backend declared (see the module doc)."""

    def __init__(self, info: SequenceInfo, kv_cache_config=None) -> None:
        self.info, self.kv_cache_config = info, kv_cache_config
        self._resource_lookup: dict = {}
        self._caches: dict = {}

    def add_resource(self, name: str, handler) -> None:
        self._resource_lookup[name] = handler

    def initialize_resources(self, num_blocks: int) -> int:
        """``num_blocks``: the placeholder C++ manager's blocks (its ``blocks_in_primary_pool``)."""
        self.info.update_cache_information(num_blocks)
        for name, handler in self._resource_lookup.items():
            if type(handler).__name__ == "KVPagedResourceHandler":
                raise NotImplementedError(f"{name}: the stand-in interface has no C++ KVCacheManager")
            self._caches[name] = handler.allocate(self.info)
        return len(self._caches)

    @property
    def caches(self) -> dict:
        return self._caches

    @property
    def named_args(self) -> dict:
        return {**self.info.named_args, **self._caches}


# ---- the transform (transform/library/kvcache.py) -------------------------------------------------------------


def _input(gm: torch.fx.GraphModule, cm: CachedSequenceInterface | None, name: str) -> torch.fx.Node:
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.target == name:
            return n
    if cm is not None:
        cm.info.activate_arg(name)
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        return gm.graph.placeholder(name)


def _is_op(node, packet) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", node.target) is packet


def insert_cached_attention(gm: torch.fx.GraphModule, cm: CachedSequenceInterface, descriptor) -> int:
    """``InsertCachedAttention._apply`` on ``gm`` with ``descriptor``; returns the number of replaced nodes."""
    source = [n for n in gm.graph.nodes if _is_op(n, descriptor.get_source_attention_op())]
    if not source:
        return 0
    meta_std = [_input(gm, cm, name) for name in descriptor.get_standard_metadata_args()]
    meta_extra = []
    prep, num_out, const_args = descriptor.get_prepare_extra_metadata_info(source[0])
    if prep is not None and num_out:
        ins = [_input(gm, cm, a.name) for a in prep._schema.arguments if a.name in cm.info.available_args]
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_before(last.next):
            ret = gm.graph.call_function(prep, args=(*ins, *const_args))
            meta_extra = [gm.graph.call_function(operator.getitem, args=(ret, i)) for i in range(num_out)]
    for idx, node in enumerate(source):
        qkv = node.args[: descriptor.get_num_qkv_args()]
        caches = []
        for k, handler in descriptor.get_cache_initializers(node, cm.kv_cache_config).items():
            cm.add_resource(f"{k}_{idx}", handler)
            caches.append(_input(gm, None, f"{k}_{idx}"))
        constants = descriptor.get_constants(node)
        with gm.graph.inserting_before(node):
            cached = gm.graph.call_function(descriptor.get_cached_attention_op(),
                                            args=(*qkv, *meta_std, *meta_extra, *caches, *constants))
        node.replace_all_uses_with(cached)
        gm.graph.erase_node(node)
    gm.recompile()
    return len(source)


def fake_propagate(gm: torch.fx.GraphModule, *example_inputs) -> None:
    """Give every node its ``meta["val"]`` (as ``torch.export`` leaves them), from ``example_inputs``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(x) for x in example_inputs))


__all__ = ["CachedSequenceInterface", "SequenceInfo", "attention_interface", "fake_propagate",
           "insert_cached_attention", "torch_attention"]
