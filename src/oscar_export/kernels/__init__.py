"""Floor 1: the cache layout, the PyTorch reference of every op, the Triton kernels and the AOT bundle."""

from .layout import KVCacheLayout, PagedKV, RowFormat
from .transform import LayerTransform

__all__ = ["KVCacheLayout", "LayerTransform", "PagedKV", "RowFormat"]
