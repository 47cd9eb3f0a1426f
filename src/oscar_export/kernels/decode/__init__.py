"""Decode attention: one entry point, one backend table.

=====================  ==============================  ==========================================================
backend                pages                           where it runs
=====================  ==============================  ==========================================================
``"hopper"``           ``"mma16"`` (fragment order)    the Gluon kernel (``kernels/decode/hopper_kernel.py``,
                                                       wrapper :mod:`.hopper`): sm_90 GPUs
``"portable"``         ``"linear"``                    the Triton kernel (:mod:`.portable`): any CUDA GPU
``"reference"``        ``"linear"``                    the PyTorch reference (``kernels/reference/``): CPU, or
                                                       without Triton
=====================  ==============================  ==========================================================

:func:`~.backend.select_backend` picks one per layer from its layout and the device; the Hugging Face cache, the
custom op (``kernels/triton_ops.py``), the AOT bundle and ``oscar-export build`` all read it, so the JIT and the
bundle launch the same kernel for the same GPU. The page packing follows the backend: the server writes the pages,
so an artifact's packing is only a default.

This package's ``__init__`` imports no Triton (``backend`` is pure Python); :mod:`.portable` and :mod:`.hopper` do.
"""

from .backend import BACKENDS, DecodeBackend, select_backend

__all__ = ["BACKENDS", "DecodeBackend", "select_backend"]
