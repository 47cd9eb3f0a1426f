"""Where the bytes are: the mixed-precision paged KV cache layout, over the row format of ``row_format.py``.

This file is the one definition every consumer reads (reference ops, Triton kernels, the Hugging Face
cache, the TensorRT-LLM adapters, export metadata, benchmark byte counts). The row format's names (``RowFormat``,
``packing_code``, the code constants) are importable from here too, where the cache's consumers read them.

Cache layout (docs/design.md §3.2)
--------------------------
Per sequence, logically ``[sink: first S0 tokens, BF16][history: INT2 pages of P tokens][recent, BF16]``.
New tokens land in *recent*; once *recent* would exceed ``W + P`` tokens, its oldest ``P`` tokens are
quantized into one page (demotion). A sequence of ``T`` tokens therefore holds::

    sink    = min(T, S0)
    pages   = max(0, ceil((T - S0 - W - P) / P))
    recent  = T - sink - pages * P            # in [W + 1, W + P] once pages > 0

Worked example (SmolLM2-135M: H_kv = 3, D = 64, G = 64, P = 64, S0 = 64, W = 256), T = 1000 tokens:
sink 64, pages ceil((1000 - 64 - 256 - 64) / 64) = 10, recent 1000 - 64 - 640 = 296.
The page pool of one layer holds, per page ``n`` and KV head ``h``:

    k_codes  uint8   [N_pages, H_kv, P, D // 4]        = [N, 3, 64, 16]
    k_params float16 [N_pages, H_kv, P, D // G, 2]     = [N, 3, 64, 1, 2]   (token granularity: scale, lo)
             float16 [N_pages, H_kv, 2, D]             = [N, 3, 2, 64]      (channel granularity: scales row, lo row)
    v_codes  uint8   [N_pages, H_kv, P, D // 4]
    v_params float16 [N_pages, H_kv, P, D // G, 2]

and sequence ``b`` addresses its pages through ``block_table[b, :pages_b]`` (int32). Sink and recent
buffers are BF16 ``[B, H_kv, S0, D]`` and ``[B, H_kv, C, D]``.

The recent window is a *ring* of ``C = W + 2P`` slots: the token at position ``t >= S0`` (recent index
``i = t - S0``) lives in slot ``i mod C``, so a demotion quantizes page ``n``'s slots ``(nP + j) mod C`` in
place and moves nothing. ``C`` is one page larger than the ``W + P`` tokens recent ever holds: a decode step
writes its new token into a free slot and its demoted page into a page no committed length reaches, so
every write of a step is invisible until the step's lengths are committed (``pages.PageBook``); a step
that fails (NaN, a full cache, an exception in any layer) leaves the cache exactly as it was. In the
example: recent indices 640..935 sit in slots 640 mod 384 = 256 .. 935 mod 384 = 167 (wrapping). Bytes of one
1000-token sequence in one layer (K and V, all heads): BF16 (64 + 296) * 3 * 64 * 2 * 2 = 276,480; INT2 10 pages *
64 tokens * 3 heads * (K 16 + 4, V 16 + 4 bytes) = 76,800; total 353,280 vs 768,000 for a BF16 cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from .row_format import (  # the row format's names, read from here by the cache's consumers
    CODE_BITS,
    CODES_PER_BYTE,
    ONE_THIRD_F32,
    PACK_LINEAR,
    PACK_MMA16_KEY,
    PACK_MMA16_VALUE,
    PACKINGS,
    UNIFORM_LEVELS,
    Granularity,
    Packing,
    RowFormat,
    check_packing,
    default_group_size,
    packing_code,
)


@dataclass(frozen=True)
class KVCacheLayout:
    """The mixed-precision paged cache of one attention layer (every layer shares one layout).

    Args:
        num_kv_heads: H_kv.
        head_dim: D.
        key: row format of keys (token or channel granularity).
        value: row format of values (token granularity).
        sink: S0, BF16 tokens kept at the start of each sequence (never demoted).
        window: W, BF16 tokens always kept at the end of each sequence.
        page_size: P, tokens per INT2 page (and per demotion). With channel-granular keys the page is the
            key quantization group, so P is part of the row format.
    """

    num_kv_heads: int
    head_dim: int
    key: RowFormat
    value: RowFormat
    sink: int = 64
    window: int = 256
    page_size: int = 64

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0:
            raise ValueError(f"KVCacheLayout.num_kv_heads: expected > 0, got {self.num_kv_heads}")
        for name, fmt in (("key", self.key), ("value", self.value)):
            if fmt.head_dim != self.head_dim:
                raise ValueError(
                    f"KVCacheLayout.{name}.head_dim: expected {self.head_dim}, got {fmt.head_dim}"
                )
        if self.value.granularity != "token":
            raise NotImplementedError("KVCacheLayout.value: only token granularity is supported for values")
        if self.sink < 0 or self.window < 0:
            raise ValueError(f"KVCacheLayout: sink and window must be >= 0, got {self.sink}, {self.window}")
        if self.page_size < 16 or self.page_size % 16:
            raise ValueError(f"KVCacheLayout.page_size: expected a multiple of 16, got {self.page_size}")
        if self.value.packing == "mma16" and self.page_size % 32:
            raise ValueError(
                f"KVCacheLayout.page_size: values packed 'mma16' need a multiple of 32, got {self.page_size}"
            )

    @classmethod
    def default(
        cls,
        num_kv_heads: int,
        head_dim: int,
        key_granularity: Granularity = "token",
        sink: int = 64,
        window: int = 256,
        page_size: int | None = None,
        packing: Packing = "linear",
    ) -> "KVCacheLayout":
        g = default_group_size(head_dim)
        return cls(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            key=RowFormat(head_dim, g, key_granularity, packing=packing),
            value=RowFormat(head_dim, g, "token", packing=packing),
            sink=sink,
            window=window,
            page_size=page_size if page_size is not None else g,
        )

    # ---- sequence bookkeeping -------------------------------------------------------------------------
    @property
    def recent_capacity(self) -> int:
        """BF16 recent slots per sequence: W + P (demotion keeps W..W+P tokens)."""
        return self.window + self.page_size

    @property
    def recent_slots(self) -> int:
        """C = W + 2P: slots of the recent ring buffer. One page more than the window ever holds, so a decode
        step writes its token and demotes a page without touching anything the committed state reads."""
        return self.window + 2 * self.page_size

    def split(self, length):
        """``(sink_len, num_pages, recent_len)`` of a sequence of ``length`` tokens (see module doc).

        ``length`` is a Python int or an integer tensor (``[B]``, elementwise, no host read): the one formula
        the reference, the caches and the page book all use.
        """
        if isinstance(length, int) and length < 0:
            raise ValueError(f"length: expected >= 0, got {length}")
        return split_length(length, self.sink, self.recent_capacity, self.page_size)

    def recent_slot(self, index):
        """Ring slot of recent index ``index`` (= token position - S0): ``index mod C``. Page ``n`` holds the
        recent indices ``[nP, nP + P)``; while they are recent they sit in slots ``(nP + t) mod C``."""
        return index % self.recent_slots

    def pages_for(self, length: int) -> int:
        return self.split(length)[1]

    # ---- shapes -----------------------------------------------------------------------------------------
    def codes_shape(self, num_pages: int, fmt: RowFormat | None = None) -> tuple[int, ...]:
        """uint8 codes of one pool: ``[N_pages, H_kv, P, D * bits / 8]`` of ``fmt`` (``key`` / ``value``); without
        ``fmt`` the two formats must have the same code bytes (a 2-bit layout), else ``ValueError``."""
        if fmt is None:
            if self.key.bytes_per_row_codes != self.value.bytes_per_row_codes:
                raise ValueError(f"codes_shape: keys ({self.key.bits}-bit) and values ({self.value.bits}-bit) "
                                 "differ; use key_codes_shape / value_codes_shape")
            fmt = self.value
        return (num_pages, self.num_kv_heads, self.page_size, fmt.bytes_per_row_codes)

    def key_codes_shape(self, num_pages: int) -> tuple[int, ...]:
        return self.codes_shape(num_pages, self.key)

    def value_codes_shape(self, num_pages: int) -> tuple[int, ...]:
        return self.codes_shape(num_pages, self.value)

    def with_key_bits(self, bits: int) -> "KVCacheLayout":
        """This layout with ``bits``-bit key codes (``bits`` 4: uniform levels, the same packing; the layer
        layout of a layer whose artifact entry says so)."""
        if bits == self.key.bits:
            return self
        return replace(self, key=replace(self.key, bits=bits, codebook=False))

    def per_layer(self, key_bits: Sequence[int]) -> tuple["KVCacheLayout", ...]:
        """Each layer's layout: layer ``i`` with ``key_bits[i]``-bit key codes (:meth:`with_key_bits`), one layout
        per layer; e.g. ``layout.per_layer((2, 4, 2))[1].key.bits == 4``. Read by the artifact, the HF cache and the
        evaluation's replay; a backend chooses the packing of each (``decode.select_backend``)."""
        return tuple(self.with_key_bits(b) for b in key_bits)

    def with_packing(self, packing: str) -> "KVCacheLayout":
        """This layout with both K and V pages in ``packing`` (the serving host's choice: ``decode.select_backend``).
        Raises what ``RowFormat`` / the layout refuse (e.g. ``NotImplementedError`` for 4-bit keys in a packing
        that does not hold them)."""
        if self.key.packing == packing and self.value.packing == packing:
            return self
        return replace(self, key=replace(self.key, packing=packing), value=replace(self.value, packing=packing))

    def params_shape(self, fmt: RowFormat, num_pages: int) -> tuple[int, ...]:
        """fp16 params: token ``[N, H_kv, P, D // G, 2]``; channel ``[N, H_kv, 2, D]`` (scale row, lo row)."""
        if fmt.granularity == "token":
            return (num_pages, self.num_kv_heads, self.page_size, fmt.groups, 2)
        return (num_pages, self.num_kv_heads, 2, self.head_dim)

    def key_params_shape(self, num_pages: int) -> tuple[int, ...]:
        return self.params_shape(self.key, num_pages)

    def value_params_shape(self, num_pages: int) -> tuple[int, ...]:
        return self.params_shape(self.value, num_pages)

    def sink_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, self.num_kv_heads, self.sink, self.head_dim)

    def recent_shape(self, batch: int) -> tuple[int, ...]:
        """The recent ring ``[B, H_kv, C, D]``, ``C = recent_slots = W + 2P``."""
        return (batch, self.num_kv_heads, self.recent_slots, self.head_dim)

    # ---- bytes --------------------------------------------------------------------------------------------
    def page_bytes(self) -> int:
        """Bytes of one INT2 page (K and V, all KV heads) in one layer."""
        per_head = self.page_size * (self.key.bytes_per_row_codes + self.value.bytes_per_row_codes)
        per_head += self.key.param_bytes_per_page(self.page_size)
        per_head += self.value.param_bytes_per_page(self.page_size)
        return self.num_kv_heads * per_head

    def bf16_token_bytes(self) -> int:
        """Bytes of one BF16 token (K and V, all KV heads) in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * 2

    def sequence_bytes(self, length: int) -> int:
        """Exact bytes a ``length``-token sequence occupies in one layer (windows BF16 + INT2 pages)."""
        sink, pages, recent = self.split(length)
        return (sink + recent) * self.bf16_token_bytes() + pages * self.page_bytes()

    def int2_bits_per_element(self) -> float:
        """Bits per element of the quantized history alone (K and V averaged; "INT2 part", 4-bit keys
        included where the layout has them)."""
        return 8.0 * self.page_bytes() / (2 * self.num_kv_heads * self.page_size * self.head_dim)

    def effective_bits_per_element(self, length: int) -> float:
        """Bits per K/V element of a whole ``length``-token sequence, BF16 windows included."""
        if length <= 0:
            raise ValueError(f"length: expected > 0, got {length}")
        return 8.0 * self.sequence_bytes(length) / (length * 2 * self.num_kv_heads * self.head_dim)

    # ---- serialisation ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["key"] = self.key.to_dict()
        d["value"] = self.value.to_dict()
        return d

    def matches_dict(self, d: Any) -> bool:
        """Whether the layout dict ``d`` (e.g. a checkpoint's ``oscar`` section, possibly written before
        ``RowFormat.packing`` existed: then ``"linear"``) describes this layout; False for malformed ``d``."""
        try:
            return KVCacheLayout.from_dict(d) == self
        except (TypeError, KeyError, ValueError, NotImplementedError, AttributeError):
            return False

    @property
    def packing(self) -> str:
        """The packing of both K and V pages; ``"mixed"`` when they differ (no kernel reads that)."""
        return self.key.packing if self.key.packing == self.value.packing else "mixed"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVCacheLayout":
        d = dict(d)
        d["key"] = RowFormat.from_dict(d["key"])
        d["value"] = RowFormat.from_dict(d["value"])
        return cls(**d)


@dataclass
class PagedKV:
    """The tensors of one layer's cache (see the module doc for shapes). Lengths are per sequence.

    Args:
        sink_k, sink_v: ``[B, H_kv, S0, D]`` BF16 (any float dtype works for the reference).
        recent_k, recent_v: ``[B, H_kv, C, D]`` rings, ``C = W + 2P`` (recent index ``i`` in slot ``i mod C``).
        k_codes, v_codes: ``[N_pages, H_kv, P, D * bits / 8]`` uint8 (``layout.key_codes_shape`` / ``value_...``).
        k_params, v_params: fp16, ``layout.key_params_shape(N)`` / ``layout.value_params_shape(N)``.
        block_table: ``[B, max_pages]`` int32 page ids (entries past ``num_pages[b]`` are ignored).
        sink_len, num_pages, recent_len: ``[B]`` int32.
    """

    sink_k: Any
    sink_v: Any
    recent_k: Any
    recent_v: Any
    k_codes: Any
    k_params: Any
    v_codes: Any
    v_params: Any
    block_table: Any
    sink_len: Any
    num_pages: Any
    recent_len: Any

    @classmethod
    def allocate(
        cls, layout: "KVCacheLayout", batch: int, pool_pages: int, max_pages: int, device: Any = "cpu",
        dtype: Any = None,
    ) -> "PagedKV":
        """Zeroed buffers for ``batch`` sequences sharing a pool of ``pool_pages`` pages."""
        import torch

        dtype = torch.bfloat16 if dtype is None else dtype
        if pool_pages <= 0 or max_pages <= 0:
            raise ValueError(f"pool_pages and max_pages must be > 0, got {pool_pages}, {max_pages}")
        z = lambda shape, dt: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        return cls(
            sink_k=z(layout.sink_shape(batch), dtype),
            sink_v=z(layout.sink_shape(batch), dtype),
            recent_k=z(layout.recent_shape(batch), dtype),
            recent_v=z(layout.recent_shape(batch), dtype),
            k_codes=z(layout.key_codes_shape(pool_pages), torch.uint8),
            k_params=z(layout.key_params_shape(pool_pages), torch.float16),
            v_codes=z(layout.value_codes_shape(pool_pages), torch.uint8),
            v_params=z(layout.value_params_shape(pool_pages), torch.float16),
            block_table=z((batch, max_pages), torch.int32),
            sink_len=z((batch,), torch.int32),
            num_pages=z((batch,), torch.int32),
            recent_len=z((batch,), torch.int32),
        )


def check_pages_fit(layout: KVCacheLayout, num_pages: int, batch: int, max_length: int) -> None:
    """Raise if a pool of ``num_pages`` cannot hold ``batch`` sequences of ``max_length`` tokens."""
    need = batch * layout.pages_for(max_length)
    if need > num_pages:
        raise ValueError(
            f"page pool too small: {batch} sequences of {max_length} tokens need {need} pages of "
            f"{layout.page_size} tokens, the pool has {num_pages}"
        )


def split_length(length, sink: int, recent_capacity: int, page_size: int):
    """:meth:`KVCacheLayout.split` from the three numbers it needs (the page book's ``oscar::write_split`` op takes
    them as its arguments)."""
    over = length - sink
    sink_len = length - over * (over > 0)  # min(length, S0)
    rest = length - sink_len
    excess = rest - recent_capacity
    pages = -(-(excess * (excess > 0)) // page_size)  # max(0, ceil(excess / P))
    return sink_len, pages, rest - pages * page_size


__all__ = [  # the layout's own names, then the row format's it re-exports
    "KVCacheLayout", "PagedKV", "check_pages_fit", "split_length",
    "CODES_PER_BYTE", "CODE_BITS", "ONE_THIRD_F32", "UNIFORM_LEVELS", "Granularity", "PACKINGS", "PACK_LINEAR",
    "PACK_MMA16_KEY", "PACK_MMA16_VALUE", "Packing", "RowFormat", "check_packing", "default_group_size", "packing_code",
]
