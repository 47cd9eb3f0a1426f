"""The Gluon API the hopper decode kernel uses, as this Triton spells it (Triton 3.6 and 3.9 checked).

``HAVE_GLUON`` is False when Triton has no Gluon, or spells one of these names otherwise: then the ``"gluon"``
(hopper) decode backend is simply not offered. Where the two checked versions differ, one name here stands for both:
:data:`cp_async` (cp.async global -> shared) and :data:`cta_barrier` (the CTA barrier). Read by
``hopper_kernel.py``, ``hopper_merge.py`` and ``hopper_operands.py``.
"""

from __future__ import annotations

try:  # Gluon (Triton 3.6 and 3.9 checked); without it, or with another spelling, "gluon" is simply not offered
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    #: cp.async global -> shared: ``async_load`` in Triton 3.9, ``async_copy_global_to_shared`` in 3.6.
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    #: the CTA barrier: ``gl.barrier()`` in Triton 3.9, ``gl.thread_barrier()`` in 3.6.
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAVE_GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - exercised only on other Triton versions
    HAVE_GLUON = False
    gluon = gl = async_copy = fence_async_shared = warpgroup_mma = cp_async = cta_barrier = None

__all__ = ["HAVE_GLUON", "async_copy", "cp_async", "cta_barrier", "fence_async_shared", "gl", "gluon", "warpgroup_mma"]
