"""The decode step's kernels compiled ahead in worker processes (``plugins/hf/precompile.py``).

On the CPU: the worker's scratch step makes the same custom-op calls as a real decode step of each layer format
(the same non-tensor arguments, the same tensor dtypes and shapes but for the page pools), so on a GPU Triton
compiles the same specialisations; no worker is started off the GPU. On the H200
(``tests/gpu/test_precompile_gpu.py``): the main process's first step finds every kernel in the on-disk cache.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oscar_export.bench import random_artifact
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf import cache_kwargs, enable_oscar, precompile

from helpers import tiny_llama

LAYOUT = KVCacheLayout.default(2, 64, "channel", sink=16, window=64, page_size=64)
POOLS = ("k_codes", "k_params", "v_codes", "v_params")


def artifact(model, key_bits, identity_layers=()):
    """``oscar_export.bench.random_artifact`` on :data:`LAYOUT` (random per-head key rotations, scalings and means),
    with identity key transforms in ``identity_layers``."""
    art = random_artifact(model, seed=1, layout=LAYOUT, key_bits=key_bits)
    ident = replace(LayerTransform.identity(LAYOUT.num_kv_heads, LAYOUT.head_dim, 0.96, 0.92), values_prerotated=True)
    return replace(art, transforms=tuple(ident if i in identity_layers else t for i, t in enumerate(art.transforms)))


class RecordOscarOps(TorchDispatchMode):
    """Records each ``oscar::`` decode custom-op call as (op, argument signature) without running it (the page
    book's ``oscar::write_split`` runs: no kernel of its own to compile ahead)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "oscar" or func.name() == "oscar::write_split":
            return func(*args, **(kwargs or {}))
        sig = []
        for a, v in zip(func._schema.arguments, args):
            if isinstance(v, torch.Tensor):
                shape = None if a.name in POOLS else tuple(v.shape)
                sig.append((a.name, v.dtype, shape, v.device.type, v.is_contiguous()))
            else:
                sig.append((a.name, v))
        self.calls.append((func.name(), tuple(sig)))
        if func.name() == "oscar::decode_attention":
            return torch.zeros(args[0].shape, dtype=args[-3], device=args[0].device)  # out_dtype
        q, rotate_q = args[2], args[-1]
        return torch.zeros(q.shape, dtype=torch.float32) if rotate_q else q.new_empty(0)


def test_the_worker_step_calls_the_ops_as_a_real_decode_step():
    """The compiled-ahead kernels are only found if the worker launches them exactly as the real step does: per
    layer format (4- and 2-bit keys, rotated and identity keys), the same ops with the same arguments."""
    model = tiny_llama(layers=3, dtype=torch.bfloat16)
    art = artifact(model, key_bits=(4, 2, 2), identity_layers=(2,))
    with torch.no_grad(), enable_oscar(model, art, backend="triton") as oscar:
        cache = oscar.make_cache(2, 300)
        assert cache.precompile is None  # no worker off the GPU
        fmts = precompile.formats(cache, oscar.shape.scaling)
        assert [(f.layout.key.bits, bool((f.transform.k_rotation == torch.eye(64)).all())) for f in fmts] == [
            (4, False), (2, False), (2, True)]
        model(torch.randint(1, 96, (2, 5)), **cache_kwargs(model, cache))  # inside the sink: no page written
        with RecordOscarOps() as real:
            model(torch.randint(1, 96, (2, 1)), position_ids=torch.full((2, 1), 5), **cache_kwargs(model, cache))
        scratch = []
        for fmt in fmts:
            with RecordOscarOps() as rec:
                precompile.run_step(fmt, "cpu")
            scratch.append(rec.calls)
    layers = [real.calls[2 * i: 2 * i + 2] for i in range(3)]
    assert [c[0] for c in real.calls] == ["oscar::decode_append", "oscar::decode_attention"] * 3
    assert layers == [scratch[0], scratch[1], scratch[2]]


def test_formats_are_distinct():
    model = tiny_llama(layers=3, dtype=torch.bfloat16)
    with torch.no_grad(), enable_oscar(model, artifact(model, key_bits=(2, 2, 2)), backend="triton") as oscar:
        assert len(precompile.formats(oscar.make_cache(1, 100), oscar.shape.scaling)) == 1
    assert precompile.start([], torch.device("cuda", 0)) is None
