"""Startup: the KV cache estimation, teardown and rebuild of ``KvCacheCreator`` (``_torch/pyexecutor/_util.py``)."""

from __future__ import annotations

import math
import sys

import torch

from .layouts import ACTIVE, COMMON


def torch_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process: the stand-in's ``torch.cuda.memory_stats``."""
    import gc

    gc.collect()  # garbage (earlier tests' tensors in cycles) is not memory in use
    sizes = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type != "meta":
            try:
                st = o.untyped_storage()
                sizes[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):  # a fake / functional tensor (a compile's) holds no memory
                continue
    return sum(sizes.values())


class KvCacheCreator:
    """The estimation, teardown and rebuild of the KV cache manager that ``create_py_executor`` runs, written from
    ``_util.py``: the 1.x copy the index stores (``_create_kv_cache_manager(self, model_engine,
    estimating_kv_cache)`` passes no ``is_estimating_kv_cache`` to the manager; ``configure_kv_cache_capacity``
    measures the peak memory, adds ``get_kv_cache_stats().allocated_bytes`` back, takes ``fraction`` (0.9 when
    unset) of it, sets ``max_tokens`` and ``max_gpu_total_bytes``) and main (d8ae02ca: passes
    ``is_estimating_kv_cache``). ``execution_stream``: ``create_py_executor`` hands it to ``KvCacheCreator``
    (``py_executor_creator.py`` @000429d5) and main's ``_create_kv_cache_manager`` passes it to the manager;
    that 1.2.1's does is not verified (the 1.x copy read predates it), so the stream tests run with and without it.
    """

    def __init__(self, *, model, mapping, max_num_tokens: int, tokens_per_block: int, max_seq_len: int,
                 max_batch_size: int, kv_cache_config, execution_stream=None) -> None:
        self._model, self._mapping, self._kv_cache_config = model, mapping, kv_cache_config
        self._execution_stream = execution_stream  # py_executor_creator.py @000429d5 creates it, passes it here
        self._max_kv_tokens_in = kv_cache_config.max_tokens
        self._max_num_tokens, self._tokens_per_block = max_num_tokens, tokens_per_block
        self._max_seq_len, self._max_batch_size = max_seq_len, max_batch_size
        util = sys.modules[COMMON["util"]]  # the module global, looked up now (a patch must precede this)
        mc = model.model_config
        self._kv_cache_manager_cls = (util.get_kv_cache_manager_cls(mc) if ACTIVE["layout"] == "1.2"
                                      else util.get_kv_cache_manager_cls(mc, kv_cache_config))
        self.dummy_requests = self._create_dummy_context_requests(max(1, max_seq_len - 1))

    def _create_dummy_context_requests(self, input_seq_len: int) -> list[int]:
        """Prompt lengths of the estimation requests (each ``max_tokens=1``)."""
        out, remaining = [], self._max_num_tokens
        n = min(self._max_num_tokens, input_seq_len)
        while remaining > 0:
            n = min(n, remaining)
            out.append(n)
            remaining -= n
        return out

    def try_prepare_estimation(self) -> bool:
        extra = 1 + 1  # one generated token, and one more with the overlap scheduler
        blocks = sum(math.ceil((n + extra) / self._tokens_per_block) for n in self.dummy_requests)
        self._kv_cache_config.max_tokens = blocks * self._tokens_per_block
        return self._model.model_config.attn_backend != "VANILLA"

    def configure_kv_cache_capacity(self, py_executor) -> None:
        """Run the dummy requests, measure the peak memory (here: bytes of live tensors, plus the stand-in C++
        pool, which upstream's C++ allocates outside torch), add the KV manager's ``allocated_bytes`` back, and set
        ``max_tokens`` and ``max_gpu_total_bytes`` from ``fraction`` of what is left."""
        fraction = self._kv_cache_config.free_gpu_memory_fraction or 0.9
        py_executor.run_dummy_requests()
        mgr = py_executor.kv_cache_manager
        peak_memory = torch_bytes() + mgr.stock_pool_bytes
        allocated_bytes = mgr.get_kv_cache_stats().allocated_bytes
        kv_max = int((py_executor.total_gpu_memory - peak_memory + allocated_bytes) * fraction)
        per_token = self._kv_cache_manager_cls.get_cache_size_per_token(
            self._model.model_config, self._mapping, tokens_per_block=self._tokens_per_block)
        if self._max_kv_tokens_in is not None:
            kv_max = min(kv_max, self._max_kv_tokens_in * per_token)
        self._kv_cache_config.max_tokens = int(kv_max // per_token)
        if self._kv_cache_config.max_gpu_total_bytes > 0:
            kv_max = min(kv_max, self._kv_cache_config.max_gpu_total_bytes)
        self._kv_cache_config.max_gpu_total_bytes = kv_max

    def build_managers(self, resources: dict, estimating_kv_cache: bool = False) -> None:
        c = self._model.model_config.pretrained_config
        resources["kv_cache_manager"] = self._kv_cache_manager_cls(
            self._kv_cache_config, "SELF", num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, tokens_per_block=self._tokens_per_block, max_seq_len=self._max_seq_len,
            max_batch_size=self._max_batch_size, mapping=self._mapping, max_num_tokens=self._max_num_tokens,
            execution_stream=self._execution_stream,
            # main's _create_kv_cache_manager passes the flag; the 1.x copy read does not
            **({} if ACTIVE["layout"] == "1.2" else {"is_estimating_kv_cache": estimating_kv_cache}))

    def teardown_managers(self, resources: dict) -> None:
        resources["kv_cache_manager"].shutdown()
        del resources["kv_cache_manager"]
