"""The OSCAR KV cache as a transformers ``Cache``: static, device-side, compileable.

One :class:`OscarLayer` per attention layer owns one ``PagedKV`` (``oscar_export.kernels.layout``): BF16
(model dtype) sink and recent-ring windows ``[B, H_kv, S0 | C, D]`` and a pool of INT2 pages. All layers
share one :class:`~oscar_export.kernels.pages.PageBook`: the pages reserved for each of the ``B`` sequence
slots (``max_length`` tokens each, reserved when the cache is made) and the per-slot lengths, on the device.
Everything stored is in the transformed basis of the layer's ``LayerTransform``. Layers may differ in their key
code width (an artifact's ``key_bits``): layer ``i`` allocates and quantizes with the base layout's
``per_layer(key_bits)[i]`` (a 4-bit layer's K pool is ``[N, H_kv, P, D / 2]``); windows, pages and the book
are the same for every layer.

transformers calls ``cache.update(k, v, layer_idx)`` right before the attention function. ``update`` writes
nothing: it returns a :class:`~.cache_layer.LayerStep` in place of the key tensor, and the ``"oscar"`` attention
function (``attention.py``) attends and writes. A model must therefore run with ``attn_implementation="oscar"``
(``enable_oscar`` sets it).

**A step is all or nothing.** The first layer begins the step on the book, every layer writes beyond the
committed lengths, the last layer commits. A decode step (one token per slot) does all of it on the device:
no host read, no allocation, no Python decision on a length, so ``torch.compile(mode="reduce-overhead")``
captures the whole model step in one CUDA graph. A slot whose new key or value is NaN/Inf in any layer, or
that would pass ``max_length``, is not committed: its cache is left exactly as it was, and its bit is set
in :meth:`OscarCache.step_status` (read it after the step, e.g. ``cache.step_status().any()``; that read
synchronises, the step itself never does). A prompt or chunk (``T > 1``) is checked on the host first and
raises one clear error before anything is committed.

``get_seq_length`` is transformers' view: input columns seen so far (padding included), a device scalar.
Each slot's real length is :meth:`OscarCache.sequence_lengths`.

**A full slot stops the run**: outside ``torch.compile`` the cache keeps, on the host, an upper bound
of each slot's length (exact after a prompt, +1 a decode step; no device read), and a decode step that would
store a token past ``max_length`` raises one ``ValueError`` before anything is written (``model.generate`` with
too small a cache stops there instead of decoding from tokens it never stored). Inside a compiled step there
is no host code: read :meth:`OscarCache.step_status` (``STATUS_FULL``) as the serving loop does.

**Contract.** A cache belongs to the model setup that made it (``enable_oscar``): after ``setup.restore()`` the
model's attention is no longer OSCAR's, and a forward with the cache fails with one clear error; a forward of
another model with it is refused too (:attr:`OscarCache.owner`). One cache is
driven by one thread at a time (its step plan and active slots live on the cache object); serve concurrent
requests from one thread through its slots, or give each thread its own cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from oscar_export.kernels import reference
from oscar_export.kernels.decode import DecodeBackend
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.pages import PageBook
from oscar_export.kernels.reference import WritePlan

from .cache_size import check_cache_size
from .ops import CacheOps, get_ops
from .oscar_layer import OscarLayer, TransformFlags
from .sliding import SlidingLayer


@dataclass
class PromptPlan:
    """What a ``T > 1`` forward writes, decided on the host by the first layer: for each input row, its slot,
    the indices of its real (non-pad) tokens among the ``T`` columns (None: all) and its committed length; and where
    every row's real tokens go, packed in row order (``reference.plan_writes``: every layer's write)."""

    slots: list[int]
    real: list[torch.Tensor | None]
    starts: list[int]
    counts: list[int]
    writes: WritePlan


class OscarCache(Cache):
    """The whole model's OSCAR cache: one :class:`OscarLayer` per attention layer, one page book.

    Args:
        layout: the base layout (windows, page size, row formats) every layer shares.
        transforms: one ``LayerTransform`` per layer.
        key_bits: key code width per layer (``layout.CODE_BITS``; an artifact's ``key_bits``); None: the layout's
            in every layer. Layer ``i`` uses ``layout.with_key_bits(key_bits[i])`` (:meth:`layer_layout`).
        batch_size: B sequence slots.
        max_length: most tokens one slot may hold (prompt + generated); its pages are reserved up front.
        device, dtype: where and in which float dtype the windows live (fp32 on CPU, BF16 on GPU).
        backend: ``"torch"`` (reference), ``"torch.compile"``, ``"triton"`` or a ``CacheOps`` (``ops.py``).
        decode_backends: one ``kernels.decode.DecodeBackend`` per layer (``enable_oscar`` picks them with
            ``select_backend``): the layer's decode kernel and so its page packing; None: the layout's packing.
        num_heads: the model's query heads; with them the backend checks and plans its launches now, not in the
            first decode step.
        sliding_layers, sliding_window: layers with a sliding window (Gemma 3's local layers) and its width W:
            they get a :class:`~.sliding.SlidingLayer` (a model-dtype ring of W tokens) instead of an
            :class:`OscarLayer`; their entries of ``transforms`` are not read (the family table says which).
    """

    is_compileable = True

    def __init__(
        self, layout: KVCacheLayout, transforms, batch_size: int, max_length: int, *,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, backend: str | CacheOps = "torch",
        sliding_layers=(), sliding_window: int | None = None, key_bits=None,
        decode_backends: "tuple[DecodeBackend, ...] | None" = None, num_heads: int | None = None,
    ) -> None:
        if len(transforms) == 0:
            raise ValueError("transforms: expected one LayerTransform per layer, got none")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (batch_size, max_length)):
            raise ValueError(f"batch_size and max_length: expected ints > 0, got {batch_size!r}, {max_length!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a float dtype for the windows, got {dtype}")
        key_bits = tuple(key_bits) if key_bits is not None else (layout.key.bits,) * len(transforms)
        if len(key_bits) != len(transforms):
            raise ValueError(f"key_bits: expected one per layer ({len(transforms)}), got {len(key_bits)}")
        ops = get_ops(backend)
        check_cache_size(layout, len(transforms), batch_size, max_length, device)
        self.book = PageBook(layout, batch_size, max_length, device)
        self.key_bits = key_bits
        if decode_backends is not None and len(decode_backends) != len(transforms):
            raise ValueError(f"decode_backends: expected one per layer ({len(transforms)}), got {len(decode_backends)}")
        #: each layer's decode backend (``kernels.decode.select_backend``: it fixes the layer's page packing); None:
        #: the layout's packing in every layer
        self.decode_backends = tuple(decode_backends) if decode_backends is not None else None
        #: query heads of the model (``enable_oscar`` passes them): the backend checks its launches when the cache
        #: is made; None: at the first decode step
        self.num_heads = num_heads
        self.layout = layout
        self.max_length = max_length
        self.active_slots: list[int] = list(range(batch_size))
        #: per slot, an upper bound of its length known on the host without a device read (module doc)
        self.host_lengths: list[int] = [0] * batch_size
        self.plan: PromptPlan | None = None
        self.seen = torch.zeros((), dtype=torch.int64, device=self.book.device)
        #: the workers compiling the decode step's kernels ahead (``precompile.py``; set by ``make_cache``; nothing
        #: waits for them)
        self.precompile = None
        #: a weak reference to the decoder of the model whose setup made this cache (``make_cache`` sets it; None: a
        #: cache made directly, used by any model); a forward of another model refuses it (``support.cache_positions``)
        self.owner = None
        sliding = set(sliding_layers)
        if sliding and (sliding_window is None or not sliding <= set(range(len(transforms)))):
            raise ValueError(f"sliding_layers {sorted(sliding)}: expected layer indices below {len(transforms)} and "
                             f"a sliding_window, got {sliding_window!r}")
        if len(sliding) == len(transforms):
            raise NotImplementedError("OscarCache: every layer slides; there is nothing for the OSCAR cache to hold")
        wide_sliding = [i for i in sorted(sliding) if key_bits[i] != layout.key.bits]
        if wide_sliding:
            raise ValueError(f"key_bits: sliding layers {wide_sliding} hold no pages; expected {layout.key.bits}, got "
                             f"{[key_bits[i] for i in wide_sliding]}")
        layers = [SlidingLayer(self, i, layout.num_kv_heads, layout.head_dim, sliding_window, dtype) if i in sliding
                  else OscarLayer(self, i, self.layer_layout(i), t, dtype, ops) for i, t in enumerate(transforms)]
        super().__init__(layers=layers)
        self.num_layers = len(layers)
        if not torch.compiler.is_compiling():  # CUDA-graph trees copy every other graph input at each replay
            for t in self.static_tensors() + self.constant_tensors():
                torch._dynamo.mark_static_address(t)

    def layer_layout(self, i: int) -> KVCacheLayout:
        """The layout of layer ``i``: the base layout with its ``key_bits[i]``-bit keys, its pages in the packing of
        its decode backend (``decode_backends[i]``, when given)."""
        if self.decode_backends is None:
            return self.layout.per_layer(self.key_bits)[i]
        return self.decode_backends[i].layout(self.layout.with_packing("linear").per_layer(self.key_bits)[i])

    def static_tensors(self) -> list[torch.Tensor]:
        """Every buffer a step reads or writes (fixed addresses: a captured graph replays over them)."""
        out = self.book.tensors() + [self.seen]
        for layer in self.layers:
            out += _layer_tensors(layer)
        return out

    def constant_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads that never change: each OSCAR layer's transform and its launch plans' tensors."""
        from dataclasses import fields

        out = []
        for layer in self.oscar_layers:
            holders = [layer.transform] + [p for p in (layer.append_plan, layer.decode_plan) if p is not None]
            out += [t for h in holders for t in (getattr(h, f.name) for f in fields(h)) if isinstance(t, torch.Tensor)]
        return out

    @property
    def oscar_layers(self) -> list[OscarLayer]:
        return [layer for layer in self.layers if isinstance(layer, OscarLayer)]

    @property
    def sliding_layers(self) -> list[SlidingLayer]:
        return [layer for layer in self.layers if isinstance(layer, SlidingLayer)]

    # ---- slots ------------------------------------------------------------------------------------------------
    @contextmanager
    def select(self, slots):
        """Within the block, forwards write only the sequence slots ``slots`` (input row i -> slots[i]).

        For serving: ``cache.reset_sequence(b)``, then ``with cache.select([b]): model(prompt, ...)`` prefills a
        new prompt into slot ``b`` while the other slots keep their sequences; decode steps run on all slots.
        """
        slots = list(slots)
        for s in slots:
            self.book.check_slot(s)
        if len(set(slots)) != len(slots) or not slots:
            raise ValueError(f"slots: expected distinct slot indices, got {slots}")
        previous, self.active_slots = self.active_slots, slots
        try:
            yield self
        finally:
            self.active_slots = previous

    def reset_sequence(self, b: int) -> None:
        """Forget slot ``b`` (its reserved pages are reused by the next sequence put there)."""
        self.book.reset(b)
        self.host_lengths[b] = 0

    def reset(self) -> None:
        self.book.reset_all()
        self.seen.zero_()
        self.host_lengths = [0] * self.book.batch

    # ---- the step (called by attention.py) ---------------------------------------------------------------------
    def begin_prompt(self, t: int, padding: torch.Tensor | None) -> PromptPlan:
        """Plan a ``T > 1`` forward (first layer; reads lengths on the host): raise before anything is written."""
        rows = len(self.active_slots)
        if padding is not None and (padding.ndim != 2 or padding.shape[0] != rows or padding.shape[1] < t):
            raise ValueError(f"attention_mask: expected a 2D padding mask [{rows}, >= {t}], got {list(padding.shape)}")
        real: list[torch.Tensor | None] = [None] * rows
        counts = [t] * rows
        if padding is not None:
            valid = padding[:, -t:].to(device=self.book.device, dtype=torch.bool)
            if not bool(valid.all()):
                real = [row.nonzero().squeeze(1) for row in valid]
                counts = [int(r.numel()) for r in real]
        lengths = self.book.seq_len.tolist()
        self.host_lengths = list(lengths)  # read anyway: exact again
        starts = [lengths[s] for s in self.active_slots]
        for s, start, n in zip(self.active_slots, starts, counts):
            if start + n > self.max_length:
                raise ValueError(
                    f"sequence slot {s}: {start} + {n} tokens exceed the cache's max_length={self.max_length}"
                )
        self.book.status.zero_()
        writes = reference.plan_writes(self.layout, zip(self.active_slots, starts, counts), self.book.max_pages,
                                       self.book.device)
        self.plan = PromptPlan(list(self.active_slots), real, starts, counts, writes)
        return self.plan

    def commit_prompt(self, t: int) -> None:
        """Last layer of a ``T > 1`` forward: the planned slots now hold their new tokens."""
        plan, self.plan = self.plan, None
        grow = torch.zeros(self.book.batch, dtype=torch.int32)
        for s, n, start in zip(plan.slots, plan.counts, plan.starts):
            grow[s] = n
            self.host_lengths[s] = start + n
        self.book.commit(grow.to(self.book.device))
        self.seen.add_(t)

    def begin_decode(self) -> None:
        if len(self.active_slots) != self.book.batch:
            raise ValueError(
                f"a decode step writes every slot: expected a batch of {self.book.batch}, the cache's, "
                f"got {len(self.active_slots)} selected slots"
            )
        if not torch.compiler.is_compiling():
            self.check_room()
        self.book.begin(1)

    def check_room(self) -> None:
        """Raise before a decode step when a slot may hold ``max_length`` tokens already (the host bound; read
        from the device only then, to be exact)."""
        if max(self.host_lengths) < self.max_length:
            return
        self.host_lengths = self.book.seq_len.tolist()
        full = [s for s, n in enumerate(self.host_lengths) if n >= self.max_length]
        if full:
            raise ValueError(
                f"sequence slot {full[0]}: the cache is full (max_length={self.max_length} tokens stored); this decode "
                f"step would drop its token and later steps would read a cache that never held it. Make the cache "
                f"with max_length >= prompt + new tokens (or reset_sequence the slot)")

    def commit_decode(self) -> None:
        self.book.commit(1)
        self.seen.add_(1)
        if not torch.compiler.is_compiling():
            self.host_lengths = [n + 1 for n in self.host_lengths]

    # ---- reads ------------------------------------------------------------------------------------------------
    def step_status(self) -> torch.Tensor:
        """``[B]`` int32 of the last step: 0 = committed; else ``pages.STATUS_NONFINITE`` (a NaN/Inf key or value)
        and/or ``pages.STATUS_FULL`` (``max_length`` reached): that slot's token was not stored. A device tensor:
        reading its values synchronises."""
        return self.book.status

    def sequence_lengths(self) -> list[int]:
        """Real tokens (pads stripped) held by each slot (reads the device)."""
        return self.book.seq_len.tolist()

    def kv_bytes(self) -> int:
        """Bytes the cached tokens occupy now, all layers: OSCAR layers from each layer's layout (windows at BF16,
        pages INT2 / 4-bit keys), sliding layers the ``min(n, W)`` tokens their ring holds (:meth:`memory` splits
        them)."""
        mem = self.memory()
        return mem["oscar_kv"] + mem["sliding_kv"]

    def bf16_bytes(self) -> int:
        """Bytes the same tokens would occupy in a BF16 cache (every layer holding every token)."""
        return self.num_layers * sum(n * self.layout.bf16_token_bytes() for n in self.sequence_lengths())

    def allocated_bytes(self) -> int:
        """Bytes of every buffer the cache reserved (all layers, all slots, the book)."""
        return sum(t.numel() * t.element_size() for t in self.static_tensors())

    def memory(self) -> dict[str, int]:
        """Bytes by part: ``oscar_allocated`` / ``sliding_allocated`` (buffers reserved by the OSCAR and the
        sliding layers), ``book_allocated`` (page book, counters), and ``oscar_kv`` / ``sliding_kv`` (what the
        tokens held now occupy). The three ``*_allocated`` sum to :meth:`allocated_bytes`. Reads the device."""
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        lengths = self.sequence_lengths()
        oscar, sliding = self.oscar_layers, self.sliding_layers
        return {
            "oscar_allocated": sum(nbytes(_layer_tensors(layer)) for layer in oscar),
            "sliding_allocated": sum(nbytes(_layer_tensors(layer)) for layer in sliding),
            "book_allocated": nbytes(self.book.tensors() + [self.seen]),
            "oscar_kv": sum(layer.layout.sequence_bytes(n) for layer in oscar for n in lengths),
            "sliding_kv": sum(layer.token_bytes() * min(n, layer.window) for layer in sliding for n in lengths),
        }


def _layer_tensors(layer) -> list[torch.Tensor]:
    if isinstance(layer, SlidingLayer):
        return layer.tensors()
    st = layer.state
    return [st.sink_k, st.sink_v, st.recent_k, st.recent_v, st.k_codes, st.k_params, st.v_codes, st.v_params]


# OscarLayer and TransformFlags live in oscar_layer.py; named here too for the modules that import them from here
__all__ = ["OscarCache", "OscarLayer", "PromptPlan", "TransformFlags"]
