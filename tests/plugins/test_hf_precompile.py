"""The decode step's kernels compiled ahead in worker processes (``plugins/hf/precompile.py``).

On the CPU: the worker's scratch step makes the same custom-op calls as a real decode step of each layer format
(the same non-tensor arguments, the same tensor dtypes and shapes but for the page pools), so on a GPU Triton
compiles the same specialisations; no worker is started off the GPU. On the H200
(``tests/gpu/test_precompile_gpu.py``): the main process's first step finds every kernel in the on-disk cache.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform
from oscar_export.plugins.hf import cache_kwargs, enable_oscar, precompile

LAYOUT = KVCacheLayout.default(2, 64, "channel", sink=16, window=64, page_size=64)
POOLS = ("k_codes", "k_params", "v_codes", "v_params")


def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def artifact(model, key_bits, identity_layers=()):
    """Random per-head key rotations, scalings and means (the identity in ``identity_layers``)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(1)
    h, d = LAYOUT.num_kv_heads, LAYOUT.head_dim
    ts = []
    for i in range(model.config.num_hidden_layers):
        t = LayerTransform.identity(h, d, 0.96, 0.92)
        if i not in identity_layers:
            t = LayerTransform(
                k_rotation=torch.linalg.qr(torch.randn(h, d, d, generator=g))[0].contiguous(),
                v_rotation=t.v_rotation, k_scale=2 ** (2 * torch.rand(h, d, generator=g) - 1), v_scale=t.v_scale,
                k_mean=0.1 * torch.randn(h, d, generator=g), v_mean=0.01 * torch.randn(h, d, generator=g),
                k_clip=t.k_clip, v_clip=t.v_clip, k_levels=t.k_levels, v_levels=t.v_levels)
        ts.append(t)
    return SimpleNamespace(layout=LAYOUT, transforms=tuple(ts), key_bits=key_bits, check_model=lambda config: None)


class RecordOscarOps(TorchDispatchMode):
    """Records each ``oscar::`` custom-op call as (op, argument signature) without running it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "oscar":
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
    model = tiny()
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
    model = tiny()
    with torch.no_grad(), enable_oscar(model, artifact(model, key_bits=(2, 2, 2)), backend="triton") as oscar:
        assert len(precompile.formats(oscar.make_cache(1, 100), oscar.shape.scaling)) == 1
    assert precompile.start([], torch.device("cuda", 0)) is None
