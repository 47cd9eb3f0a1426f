"""How one row is stored: the INT2 (or 4-bit key) row format and the order of its codes in a page (``RowFormat``).

A row format is one of the two halves of a layer's cache layout (``layout.py``: ``KVCacheLayout.key`` and
``.value``); every consumer reads it through there or from here.

Row format (docs/design.md §3.1)
------------------------
A *row* is one token of one KV head: ``D`` values in the rotated basis. Values are quantized in groups
of ``G`` consecutive elements along ``D`` ("token" granularity). Keys may instead be quantized per
channel within a page ("channel" granularity: one ``(scale, lo)`` pair per channel over the ``P`` tokens
of a page, KIVI-style). Either way each quantization group stores an fp16 ``(scale, lo)`` pair and every
element a 2-bit code ``c``; it reads back as ``lo + scale * levels[c]`` with ``levels = (0, 1, 2, 3)``
unless a fitted codebook replaces them.

Wider keys (``RowFormat.bits == 4``): the layers whose artifact entry says so store 4-bit key codes,
uniform levels ``0..15``, the same fp16 ``(scale, lo)`` params and the same rule with 16 levels; in ``"linear"``
packing byte ``b`` of a packing group holds elements ``b, b + G/2`` at bits 0, 4 (the general rule: elements
``b + j G / c`` at bits ``j * bits`` for the ``c = 8 / bits`` codes of a byte). Their K pool is ``[N, H_kv, P,
D / 2]``; values stay 2-bit.

Packing (``RowFormat.packing``, the same for both granularities) says where each 2-bit code sits inside
the ``P * D / 4`` code bytes of one page of one KV head:

* ``"linear"`` (the default, what every artifact without the field means): 4 codes per byte along ``D``;
  inside a packing group of ``G`` elements, byte ``b`` of a row holds elements ``b, b + G/4, b + G/2,
  b + 3G/4`` at bits 0, 2, 4, 6; rows follow each other (``[P, D // 4]``).
* ``"mma16"``: the page is ordered for the tensor-core fragments of the Hopper decode kernel, so that one
  16-byte load per thread is exactly the codes of that thread's ``mma.m16n8k16`` A fragments (keys: tokens
  on M, dims on K; values: dims on M, tokens on K, so one token's codes are spread over the page). The
  exact bit mapping is defined, with a worked example, in ``reference.pack_mma16``.

Both packings take the same bytes and the same tensor shapes; only the order differs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Granularity = Literal["token", "channel"]
Packing = Literal["linear", "mma16"]
#: every packing this code knows; an artifact or a kernel bundle naming another one is refused on load.
PACKINGS = ("linear", "mma16")

#: fp32 value of 1/3: the quantizer multiplies by it instead of dividing (bit-exact in torch and Triton).
ONE_THIRD_F32 = 0.3333333432674408
#: 2-bit codes per byte (the default row format; ``RowFormat.codes_per_byte`` is the general one).
CODES_PER_BYTE = 4
#: code widths a row format may have: 2 (the cache's INT2) and 4 (wider key pages of the layers that need
#: them: uniform levels 0..15, linear or mma16 packing, no codebook).
CODE_BITS = (2, 4)
#: uniform 2-bit levels (a fitted codebook replaces them; level 0 is 0 and level 3 is 3 in both).
UNIFORM_LEVELS = (0.0, 1.0, 2.0, 3.0)


def check_packing(packing: Any, what: str = "packing") -> None:
    """Raise ``ValueError`` unless ``packing`` is one of :data:`PACKINGS` (one message for every loader)."""
    if not isinstance(packing, str) or packing not in PACKINGS:
        raise ValueError(f"{what}: unknown packing {packing!r}; this version knows {list(PACKINGS)}")


#: ``PACKING`` constexpr of the kernels that write or read pages (one pool each): linear, mma16 keys
#: (``[P, D]`` on the MMA's M x K), mma16 values (``[D, P]``); see ``reference.pack_page_codes``.
PACK_LINEAR, PACK_MMA16_KEY, PACK_MMA16_VALUE = 0, 1, 2


def packing_code(fmt: "RowFormat", operand: str) -> int:
    """The ``PACKING`` constexpr for pages of ``fmt`` in the ``operand`` (``"key"``/``"value"``) pool."""
    if operand not in ("key", "value"):
        raise ValueError(f"operand: expected 'key' or 'value', got {operand!r}")
    if fmt.packing == "linear":
        return PACK_LINEAR
    return PACK_MMA16_KEY if operand == "key" else PACK_MMA16_VALUE


def default_group_size(head_dim: int) -> int:
    """docs/design.md §3.1: ``G = head_dim`` when ``head_dim <= 128``, else 128."""
    return head_dim if head_dim <= 128 else 128


@dataclass(frozen=True)
class RowFormat:
    """How one K or V row (``head_dim`` values of one token of one KV head) is quantized.

    Args:
        head_dim: D, elements per row; a multiple of 4 (>= 16).
        group_size: G, elements per packing group (and per quantization group at token granularity);
            divides ``head_dim`` and is a multiple of 4.
        granularity: ``"token"`` (one (scale, lo) per G elements of a row) or ``"channel"`` (one
            (scale, lo) per channel over the P tokens of a page; keys only).
        bits: bits per code, one of :data:`CODE_BITS`: 2 (levels 0..3 or a fitted codebook) or 4 (uniform levels
            0..15, no codebook).
        codebook: False for the uniform levels 0..3; True when the artifact supplies fitted levels.
        packing: order of the codes inside a page (module doc): ``"linear"`` (default) or ``"mma16"``
            (fragment order of the Hopper decode kernel; needs ``head_dim`` a multiple of 32).
    """

    head_dim: int
    group_size: int
    granularity: Granularity = "token"
    bits: int = 2
    codebook: bool = False
    packing: Packing = "linear"

    def __post_init__(self) -> None:
        if self.bits not in CODE_BITS:
            raise NotImplementedError(f"RowFormat.bits: {list(CODE_BITS)} are implemented, got {self.bits}")
        if self.bits != 2 and self.codebook:
            raise NotImplementedError(f"RowFormat.bits {self.bits}: only uniform levels (got codebook=True)")
        if self.head_dim < 16 or self.head_dim % 4:
            raise ValueError(f"RowFormat.head_dim: expected a multiple of 4 >= 16, got {self.head_dim}")
        if self.group_size <= 0 or self.group_size % 4 or self.head_dim % self.group_size:
            raise ValueError(
                f"RowFormat.group_size: expected a multiple of 4 dividing head_dim={self.head_dim}, "
                f"got {self.group_size}"
            )
        if self.granularity not in ("token", "channel"):
            raise ValueError(f"RowFormat.granularity: expected 'token' or 'channel', got {self.granularity!r}")
        check_packing(self.packing, "RowFormat.packing")
        if self.packing == "mma16" and self.head_dim % 32:
            raise ValueError(f"RowFormat.packing 'mma16': head_dim must be a multiple of 32, got {self.head_dim}")

    @classmethod
    def default(cls, head_dim: int, granularity: Granularity = "token") -> "RowFormat":
        return cls(head_dim=head_dim, group_size=default_group_size(head_dim), granularity=granularity)

    @property
    def groups(self) -> int:
        """Packing groups per row (D // G)."""
        return self.head_dim // self.group_size

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    @property
    def levels(self) -> int:
        """Number of code levels, ``2 ** bits``."""
        return 1 << self.bits

    @property
    def bytes_per_row_codes(self) -> int:
        return self.head_dim // self.codes_per_byte

    def param_bytes_per_page(self, page_size: int) -> int:
        """fp16 (scale, lo) bytes for one KV head of one page."""
        if self.granularity == "token":
            return page_size * self.groups * 2 * 2
        return self.head_dim * 2 * 2

    def bits_per_element(self, page_size: int) -> float:
        """Stored bits per quantized element, codes and params."""
        page_bytes = page_size * self.bytes_per_row_codes + self.param_bytes_per_page(page_size)
        return 8.0 * page_bytes / (page_size * self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RowFormat":
        return cls(**d)


__all__ = [
    "CODES_PER_BYTE",
    "CODE_BITS",
    "ONE_THIRD_F32",
    "UNIFORM_LEVELS",
    "Granularity",
    "PACKINGS",
    "PACK_LINEAR",
    "PACK_MMA16_KEY",
    "PACK_MMA16_VALUE",
    "Packing",
    "RowFormat",
    "check_packing",
    "default_group_size",
    "packing_code",
]
