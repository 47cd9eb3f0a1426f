"""``select_backend``: which decode kernel reads a layer's pages on a device, and so in which order they are written.

The one place the choice is made (the package doc lists the backends). Read by the Hugging Face cache
(``plugins/hf``), the custom op (``kernels/triton_ops.py``), the AOT bundle (``kernels/aot/bundle.py``) and
``oscar-export build``. Pure Python: importing it needs no Triton.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..checks import check_hopper_layout
from ..layout import KVCacheLayout

#: backend name -> the page packing it reads.
BACKENDS = {"hopper": "mma16", "portable": "linear", "reference": "linear"}


@dataclass(frozen=True)
class DecodeBackend:
    """A layer's decode kernel and the packing of its pages.

    Args:
        name: a key of :data:`BACKENDS`.
        why: why no faster backend was taken ("" for the fastest one); logged, and said in benchmark rows.
    """

    name: str
    why: str = ""

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise ValueError(f"DecodeBackend.name: expected one of {sorted(BACKENDS)}, got {self.name!r}")

    @property
    def packing(self) -> str:
        return BACKENDS[self.name]

    def layout(self, layout: KVCacheLayout) -> KVCacheLayout:
        """``layout`` with its pages in this backend's packing."""
        return layout.with_packing(self.packing)


def _capability(device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device, an sm arch number (``90``) or a ``(major, minor)`` pair."""
    if isinstance(device, tuple):
        return device
    if isinstance(device, int):
        return divmod(device, 10)
    return tuple(torch.cuda.get_device_capability(torch.device(device)))


def have_triton() -> bool:
    """Whether Triton is installed (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:  # an import hook that refuses it
        return False


def select_backend(layout: KVCacheLayout, device, num_heads: int) -> DecodeBackend:
    """The decode backend for a layer of ``layout`` (any packing: the result says which one to write) serving
    ``num_heads`` query heads on ``device``: a ``torch.device`` / string, or, for a bundle built without a GPU,
    the target's sm arch (``90``) or ``(major, minor)``.

    Hopper (sm_90) with Gluon, for the formats the Gluon kernel reads -> ``"hopper"``; any other CUDA GPU, or a
    format the Gluon kernel does not read -> ``"portable"``; the CPU or no Triton -> ``"reference"``.
    """
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "cuda":
        return DecodeBackend("reference", f"the {torch.device(device).type.upper()} runs the PyTorch reference")
    if not have_triton():
        return DecodeBackend("reference", "Triton is not installed")
    cap = _capability(device)
    if cap != (9, 0):
        return DecodeBackend("portable", f"the Gluon kernel needs sm_90, this GPU is sm_{cap[0]}{cap[1]}")
    from . import hopper  # Triton from here on

    if not hopper.HAVE_GLUON:
        return DecodeBackend("portable", "this Triton has no Gluon")
    try:
        check_hopper_layout(layout.with_packing("mma16"), num_heads)
    except (NotImplementedError, ValueError) as e:
        return DecodeBackend("portable", str(e))
    return DecodeBackend("hopper")


def backends_by_width(layout: KVCacheLayout, key_bits, device, num_heads: int) -> dict[int, DecodeBackend]:
    """The decode backend of each key code width in ``key_bits`` (a model's per-layer widths, any order, repeats
    allowed): :func:`select_backend` of ``layout`` with that width (``KVCacheLayout.with_key_bits``) on ``device``.
    The one chain from a base layout and a width to a backend (and so a packing) that the HF cache, the AOT bundle
    and ``oscar-export build`` read; e.g. ``{2: DecodeBackend("hopper"), 4: DecodeBackend("hopper")}`` on an H100."""
    base = layout.with_packing("linear")
    return {b: select_backend(base.with_key_bits(b), device, num_heads) for b in sorted(set(key_bits))}


__all__ = ["BACKENDS", "DecodeBackend", "backends_by_width", "have_triton", "select_backend"]
