"""The methods the evaluation compares, built for one model: baselines, the research recipe, ours.

``baseline_methods`` needs only the model's attention shape. ``research_recipe`` reproduces the OSCAR research
code's recipe: per layer ONE rotation shared by the KV heads, ``R = U·H`` (eigenvectors of the key target
``C_Q = E[q qᵀ]`` over all query heads, resp. of the value target weighted by ``w_t = k_tᵀ C_Q k_t``
normalised to mean 1, then the normalised Hadamard), global clip ratios K 0.96 / V 0.92, fp32 scale and
minimum. Its statistics come from a small capture on the calibration text (the first 70 % of the pydoc
topics, never the evaluation text). ``ours_method`` wraps a calibration artifact.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from oscar_export.calibration.families import family_for
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform, hadamard

from .attention import EvalContext, evaluating
from .cache_models import BF16Cache, CacheModel, Kivi2, PagedInt2
from .hf_quantized import HFQuantized

RESEARCH_CLIPS = (0.96, 0.92)


def attention_shape(model) -> tuple[int, int, int, int]:
    """``(layers, query heads, KV heads, head_dim)`` from the model-family table (``calibration/families.py``);
    raises its ``NotImplementedError`` for a model the table refuses, and one for sliding-window layers (the
    evaluation's cache models hold full-attention layers only)."""
    f = family_for(model)
    if f.sliding_layers:
        raise NotImplementedError(
            f"eval: {f.family.name} model with sliding-window attention in {len(f.sliding_layers)} of {f.num_layers} "
            "layers; the evaluation's cache models support full-attention layers only"
        )
    return f.num_layers, f.num_heads, f.num_kv_heads, f.head_dim


def _with_rotation(t: LayerTransform, rk: torch.Tensor, rv: torch.Tensor) -> LayerTransform:
    return replace(t, k_rotation=rk.float().contiguous(), v_rotation=rv.float().contiguous())


def baseline_methods(model, layout: KVCacheLayout | None = None) -> list[CacheModel]:
    """BF16, naive INT2, QuaRot-INT2 (token and channel keys), KIVI-2 (paper defaults and matched budget),
    HF QuantizedCache HQQ/quanto at 2 bits and, as a reference point above us, 4 bits."""
    n_layers, _, hkv, d = attention_shape(model)
    base = layout or KVCacheLayout.default(hkv, d)
    # baselines use per-token keys (the classic INT2 formats) with our windows, whatever the artifact chose;
    # "quarot-int2-channel" isolates what per-channel keys alone give (same layout as a channel-key artifact)
    lay = KVCacheLayout.default(hkv, d, "token", sink=base.sink, window=base.window, page_size=base.page_size)
    lay_ch = KVCacheLayout.default(hkv, d, "channel", sink=base.sink, window=base.window, page_size=base.page_size)
    ident = [LayerTransform.identity(hkv, d) for _ in range(n_layers)]
    h = hadamard(d).float().expand(hkv, d, d)
    had = [_with_rotation(t, h, h) for t in ident]
    g = lay.key.group_size
    matched = -(-(lay.sink + lay.window) // g) * g  # S0 + W rounded up to whole key groups
    hf = [HFQuantized(f"hf-{b}-int{n}", f"transformers QuantizedCache(backend={b!r}, nbits={n}), defaults",
                      backend=b, nbits=n) for n in (2, 4) for b in ("hqq", "quanto")]
    return [
        BF16Cache("bf16", "BF16 cache (every row rounded to bfloat16)"),
        PagedInt2("int2-naive", "our layout, no rotation, no clipping", layout=lay, transforms=ident),
        PagedInt2("quarot-int2", "our layout, Hadamard rotation, no clipping", layout=lay, transforms=had),
        PagedInt2("quarot-int2-channel", "as quarot-int2 but keys per channel within a page (our key format)",
                  layout=lay_ch, transforms=had),
        Kivi2("kivi2", "KIVI-2: keys per channel / values per token, group 32, residual 128", group=32, residual=128),
        Kivi2("kivi2-matched",
              f"KIVI-2 at our budget: group {g} (same bits), residual {matched} (S0 + W full-precision tokens)",
              group=g, residual=matched),
        *hf,
    ]


@torch.no_grad()
def capture_qkv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Post-RoPE ``(q [H, T, D], k [H_kv, T, D], v [H_kv, T, D])`` per layer for ``ids [N, T]`` (concatenated)."""
    ctx = EvalContext([BF16Cache("bf16")], "score", torch.float32)
    ctx.capture = {}
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    dev = next(model.parameters()).device
    with evaluating(model):
        for row in ids:
            base(input_ids=row.view(1, -1).to(dev), use_cache=False, oscar_eval=ctx)
    return [tuple(torch.cat(parts, 1) for parts in zip(*ctx.capture[i])) for i in sorted(ctx.capture)]


def _eig_desc(c: torch.Tensor) -> torch.Tensor:
    w, u = torch.linalg.eigh(c.double())
    return u.flip(-1)  # columns by descending eigenvalue


def research_recipe(model, calib_ids: torch.Tensor, layout: KVCacheLayout | None = None) -> PagedInt2:
    """The OSCAR research recipe (module doc) from a capture of ``calib_ids [N, T]`` calibration tokens."""
    n_layers, _, hkv, d = attention_shape(model)
    lay = layout or KVCacheLayout.default(hkv, d)
    lay = KVCacheLayout.default(hkv, d, "token", sink=lay.sink, window=lay.window, page_size=lay.page_size)
    had = hadamard(d)
    transforms = []
    for q, k, v in capture_qkv(model, calib_ids):
        qd = q.double().reshape(-1, d)
        c_q = qd.T @ qd / qd.shape[0]
        w = ((k.double() @ c_q) * k.double()).sum(-1)  # [H_kv, T]
        w = w / w.mean()
        vd = v.double()
        c_v = torch.einsum("ht,hti,htj->ij", w, vd, vd) / w.sum()
        had_d = had.to(c_q.device).double()
        rk = (_eig_desc(c_q) @ had_d).float().expand(hkv, d, d)
        rv = (_eig_desc(c_v) @ had_d).float().expand(hkv, d, d)
        base = LayerTransform.identity(hkv, d, *RESEARCH_CLIPS)
        transforms.append(_with_rotation(base, rk, rv).to(q.device))
    return PagedInt2("oscar-research", "research recipe: shared per-layer U·H, clips 0.96/0.92, fp32 params",
                     layout=lay, transforms=tuple(transforms), param_dtype="float32")


def ours_method(artifact, name: str = "oscar", description: str = "") -> PagedInt2:
    """Our calibrated cache from an ``OscarArtifact`` (layout, per-layer transforms, row formats, key widths)."""
    cfg = getattr(artifact, "config", {}) or {}
    desc = description or "ours: " + ", ".join(
        f"{k}={cfg[k]}" for k in ("per_head", "rotation", "clip", "key_granularity", "key_mean", "value_mean",
                                  "codebook") if k in cfg
    )
    return PagedInt2(name, desc, layout=artifact.layout, transforms=tuple(artifact.transforms),
                     key_bits=tuple(getattr(artifact, "key_bits", ())))


__all__ = ["RESEARCH_CLIPS", "attention_shape", "baseline_methods", "capture_qkv",
           "ours_method", "research_recipe"]
