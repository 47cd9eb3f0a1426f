"""The fake quantizers the cache models use: every INT2 rule goes through ``kernels.reference``.

* pages (ours, naive INT2, QuaRot): ``reference.quantize_pages`` / ``dequantize_pages``, the real row format,
  clip ratios and levels of a ``LayerTransform``: bit-identical to what the cache stores.
* KIVI-2: ``reference.quantize_groups`` with no clipping (rank ``n - 1``) and levels 0..3: asymmetric min-max
  round to nearest with fp16 scale and minimum, along the axis KIVI groups.
* the research recipe's fp32 scale and minimum: the one rule the reference has no option for
  (``quantize_groups`` always stores fp16 params). :func:`fp32_param_roundtrip` is that rule with the
  params kept in fp32, written as the reference's arithmetic with the two fp16 casts left out; a test pins
  it to the reference wherever fp16 rounding is exact.
* wider codes (an artifact's 4-bit key layers): :func:`page_roundtrip` on the layout with 4-bit keys
  (``KVCacheLayout.with_key_bits``), the reference's 16-level rule.
* transformers' ``QuantizedCache``: the real backend layer (``HQQQuantizedLayer`` / ``QuantoQuantizedLayer``).
"""

from __future__ import annotations

import torch

from oscar_export.kernels.layout import ONE_THIRD_F32, KVCacheLayout
from oscar_export.kernels.reference import dequantize_groups, dequantize_pages, quantize_groups, quantize_pages
from oscar_export.kernels.transform import LayerTransform, clip_rank

PARAM_DTYPES = ("float16", "float32")
HF_BACKENDS = ("hqq", "quanto")


def page_roundtrip(x: torch.Tensor, layout: KVCacheLayout, transform: LayerTransform, side: str,
                   param_dtype: str = "float16") -> torch.Tensor:
    """``x [H_kv, N*P, D]`` stored-basis rows of whole pages -> dequantized rows ``[H_kv, N*P, D]`` float32.

    ``param_dtype="float16"`` is the cache's own format (the reference, bit-exactly); ``"float32"`` keeps
    scale and minimum in fp32 (token granularity only).
    """
    h, t, d = x.shape
    n = t // layout.page_size
    pages = x.reshape(h, n, layout.page_size, d).transpose(0, 1)  # [N, H_kv, P, D]
    fmt = layout.key if side == "k" else layout.value
    clip = (transform.k_clip if side == "k" else transform.v_clip).to(x.device)
    levels = (transform.k_levels if side == "k" else transform.v_levels).to(x.device)
    if param_dtype == "float16":
        codes, params = quantize_pages(pages, fmt, clip, levels)
        out = dequantize_pages(codes, params, fmt, levels)
    elif param_dtype == "float32":
        if fmt.granularity != "token":
            raise NotImplementedError("fp32 params are implemented for token-granular rows only")
        g = fmt.group_size
        rank = clip_rank(clip, g).view(1, h, 1, 1, 1)
        grouped = pages.reshape(n, h, layout.page_size, d // g, g)
        out = fp32_param_roundtrip(grouped, rank, levels.view(1, h, 1, 1, 4)).reshape(n, h, layout.page_size, d)
    else:
        raise ValueError(f"param_dtype: expected one of {PARAM_DTYPES}, got {param_dtype!r}")
    return out.transpose(0, 1).reshape(h, t, d)


def fp32_param_roundtrip(x: torch.Tensor, rank: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``quantize_groups`` + ``dequantize_groups`` with fp32 (not fp16) scale and minimum: ``x [..., n]``."""
    x = x.float()
    srt = x.abs().sort(dim=-1).values
    thr = torch.gather(srt, -1, rank.expand(*x.shape[:-1], 1))
    xc = torch.minimum(torch.maximum(x, -thr), thr)
    lo = xc.amin(dim=-1, keepdim=True)
    s = (xc.amax(dim=-1, keepdim=True) - lo) * ONE_THIRD_F32
    d = xc - lo
    lv = levels.float()
    t = (lv[..., :-1] + lv[..., 1:]) * 0.5
    codes = (d >= t[..., 0:1] * s).long() + (d >= t[..., 1:2] * s).long() + (d >= t[..., 2:3] * s).long()
    return lo + s * torch.gather(lv.expand(*codes.shape[:-1], 4), -1, codes)


def minmax_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric min-max 2-bit round to nearest along the last axis, fp16 params: the reference, no clipping."""
    rank = torch.full((1,), x.shape[-1] - 1, dtype=torch.long, device=x.device)
    levels = torch.tensor([0.0, 1.0, 2.0, 3.0], device=x.device)
    codes, scale, lo = quantize_groups(x.float(), rank, levels)
    return dequantize_groups(codes, scale, lo, levels)


def kivi_keys(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[H_kv, T, D]`` (T a multiple of ``group``): per channel over ``group`` tokens."""
    h, t, d = x.shape
    g = x.reshape(h, t // group, group, d).transpose(-1, -2)  # [H, T/g, D, g]
    return minmax_roundtrip(g).transpose(-1, -2).reshape(h, t, d)


def kivi_values(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[H_kv, T, D]``: per token over ``group`` channels."""
    h, t, d = x.shape
    if d % group:
        raise ValueError(f"KIVI: head_dim {d} is not a multiple of the group size {group}")
    return minmax_roundtrip(x.reshape(h, t, d // group, group)).reshape(h, t, d)


def hf_backend_layer(backend: str, nbits: int, group: int, residual: int, like: torch.Tensor):
    """The real transformers ``QuantizedLayer`` of ``backend``, lazily initialised on ``like [1, H_kv, 1, D]``."""
    if backend not in HF_BACKENDS:
        raise ValueError(f"backend: expected one of {HF_BACKENDS}, got {backend!r}")
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = HQQQuantizedLayer if backend == "hqq" else QuantoQuantizedLayer
    layer = cls(nbits=nbits, q_group_size=group, residual_length=residual)
    layer.lazy_initialization(like, like)
    return layer


def hf_backend_missing(backend: str, device: torch.device | str | None = None) -> str | None:
    """Why transformers' ``QuantizedCache(backend=...)`` cannot run here, or None when it can: the module the
    backend layer uses must import, and with ``device`` one small quantize/dequantize must run there (a
    package present without its own dependencies, or without kernels for the device, counts as missing)."""
    import importlib

    module, extra = {"hqq": ("hqq.core.quantize", "hqq"), "quanto": ("optimum.quanto", "optimum-quanto")}[backend]
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install failing on import
        return f"QuantizedCache(backend={backend!r}) needs the package {extra} (pip install {extra}): {e}"
    if device is not None:
        try:
            x = torch.randn(1, 2, 16, 64, device=device)
            layer = hf_backend_layer(backend, 2, 64, 8, x[:, :, :1])
            layer._dequantize(layer._quantize(x, axis=layer.axis_key))
        except Exception as e:  # noqa: BLE001 - any failure here would stop the whole run later
            return f"QuantizedCache(backend={backend!r}) fails on {device}: {type(e).__name__}: {e}"
    return None


def add_noise_like(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Gaussian noise with the per-head mean and std of ``x [H_kv, T, D]`` (deterministic, CPU generator)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.device)
    mean = x.mean(dim=(1, 2), keepdim=True)
    std = x.std(dim=(1, 2), keepdim=True)
    return mean + std * z


__all__ = [
    "HF_BACKENDS", "PARAM_DTYPES", "add_noise_like", "fp32_param_roundtrip", "hf_backend_layer", "hf_backend_missing",
    "kivi_keys", "kivi_values", "minmax_roundtrip", "page_roundtrip",
]
