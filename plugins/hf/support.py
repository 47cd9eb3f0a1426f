"""Which Hugging Face models the OSCAR cache supports, and ``enable_oscar``: the one entry point.

Supported: the families of the model-family table (``calibration/families.py``: Llama, Mistral, Mixtral,
Qwen2, Qwen3, Qwen3-MoE, GLM-4, GLM-4-MoE, Gemma 3 text) with full attention in every layer, except Gemma 3,
whose interleaved sliding-window layers keep their window in a plain model-dtype cache (``sliding.py``). Their attention
modules apply RoPE (and q/k norms) before ``cache.update``, so the cache and the attention function see exactly
the post-RoPE keys and queries DESIGN §4 asks for. Anything else raises the table's ``NotImplementedError``
naming the architecture or the feature.
"""

from __future__ import annotations

import importlib.util
import logging

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from oscar_export.calibration.families import FAMILIES, ModelAttention, family_for
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

from .attention import ATTENTION_NAME, oscar_attention, oscar_mask
from .cache import OscarCache
from .ops import CacheOps, get_ops

log = logging.getLogger(__name__)

#: ``config.model_type`` values the cache supports (the family table's keys).
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

#: What the cache needs to know about a model's attention (L, H, H_kv, D, scale, ...): the table's resolved facts.
AttentionShape = ModelAttention


def model_attention_shape(model_or_config: Any) -> AttentionShape:
    """Validate a model (or its config) against the family table and return its attention facts.

    Raises:
        NotImplementedError: an architecture the table does not know, or an attention feature it does not
            support (sliding-window layers, soft-capping, MLA, an unknown RoPE type); the message names it.
    """
    return family_for(model_or_config)


def register_attention() -> None:
    """Register ``"oscar"`` with transformers' AttentionInterface and AttentionMaskInterface (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, oscar_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, oscar_mask)


def _load_artifact(artifact: Any) -> Any:
    if isinstance(artifact, (str, Path)):
        try:
            from oscar_export.calibration.artifact import load_artifact
        except ModuleNotFoundError as e:
            raise ImportError(f"loading an artifact needs oscar_export.calibration.artifact: {e}") from e
        return load_artifact(artifact)
    for name in ("layout", "transforms", "check_model"):
        if not hasattr(artifact, name):
            raise ValueError(f"artifact: expected a directory path or an OscarArtifact, got {type(artifact).__name__}")
    return artifact


@dataclass(frozen=True)
class OscarSetup:
    """A model switched to the OSCAR cache; makes caches for it and can switch it back.

    Also a context manager: ``with enable_oscar(model) as oscar: ...`` restores the previous attention
    implementation on exit.
    """

    model: Any
    shape: AttentionShape
    layout: KVCacheLayout
    transforms: tuple[LayerTransform, ...]
    ops: CacheOps
    previous_attn_implementation: str
    key_bits: tuple[int, ...] | None = None
    decode_variant: str | None = None

    def make_cache(self, batch_size: int, max_length: int) -> OscarCache:
        """A fresh cache for ``batch_size`` sequence slots of up to ``max_length`` tokens each (prompt +
        generated); every page they can need is reserved now. Windows take the model's dtype and device."""
        p = next(self.model.parameters())
        return OscarCache(self.layout, self.transforms, batch_size, max_length, device=p.device, dtype=p.dtype,
                          backend=self.ops, sliding_layers=self.shape.sliding_layers,
                          sliding_window=self.shape.sliding_window, key_bits=self.key_bits,
                          decode_variant=self.decode_variant)

    def restore(self) -> None:
        """Switch the model back to the attention implementation it had before ``enable_oscar``."""
        self.model.set_attn_implementation(self.previous_attn_implementation)

    def __enter__(self) -> "OscarSetup":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def resolve_backend(model: Any, backend: str | CacheOps) -> str | CacheOps:
    """``"auto"`` -> ``"triton"`` for a BF16 model on CUDA when Triton imports, else ``"torch"``."""
    if backend != "auto":
        return backend
    p = next(model.parameters())
    if p.is_cuda and p.dtype == torch.bfloat16 and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def enable_oscar(
    model: Any,
    artifact: Any = None,
    backend: str | CacheOps = "auto",
    *,
    layout: KVCacheLayout | None = None,
    key_granularity: str = "channel",
    k_clip: float = 1.0,
    v_clip: float = 1.0,
    key_bits: Sequence[int] | None = None,
    decode_variant: str | None = None,
) -> OscarSetup:
    """Switch ``model`` to the OSCAR cache: validate it, register and select the ``"oscar"`` attention.

    Args:
        model: a transformers causal LM (Llama family, Qwen2, Qwen3).
        artifact: None (identity transforms, clip ratios ``k_clip``/``v_clip``, the default layout with
            ``key_granularity`` keys), an ``OscarArtifact`` or the path of an artifact directory (checked
            against the model).
        backend: ``"auto"`` (``"triton"`` for a BF16 model on CUDA with Triton installed, else ``"torch"``),
            ``"torch"`` (reference ops), ``"torch.compile"``, ``"triton"`` (GPU kernels, BF16 model), or a
            ``CacheOps`` (``ops.py``).
        layout: without an artifact, a layout to use instead of ``KVCacheLayout.default`` (e.g. small
            windows for tests).
        key_granularity: without an artifact or layout, ``"channel"`` (KIVI-style per-channel keys within a
            page, the default) or ``"token"``. Measured on SmolLM2 (800-token prompt, first 32 greedy tokens vs
            BF16): identity rotation with per-token keys agreed on 2/32 tokens, with per-channel keys 28/32.
        key_bits: without an artifact, the key code width of each layer (``layout.CODE_BITS``; e.g. 4-bit keys
            in some layers for a speed or memory benchmark); an artifact carries its own.
        decode_variant: with ``backend="triton"`` and mma16 pages (``RowFormat.packing``), the decode kernel
            (``kernels.decode_attention_v2.KERNELS``: ``"fields"``, ``"tile"``, or ``"gluon"``, the Gluon kernel,
            Hopper only); None picks ``decode_attention_v2.default_variant`` ("gluon" where it runs — a model on
            a Hopper GPU, uniform codes, the head shapes it takes — else "fields", the reason logged at INFO).
            Must be None otherwise (linear pages have one kernel, v1).
    Returns:
        an :class:`OscarSetup`; ``setup.make_cache(batch_size, max_length)`` gives the cache to pass as
        ``past_key_values``.
    """
    shape = model_attention_shape(model)
    ops = get_ops(resolve_backend(model, backend))
    if artifact is None:
        key_bits = tuple(key_bits) if key_bits is not None else None
        if key_bits is not None and len(key_bits) != shape.num_layers:
            raise ValueError(f"key_bits: expected one per layer ({shape.num_layers}), got {len(key_bits)}")
        layout = layout or KVCacheLayout.default(shape.num_kv_heads, shape.head_dim, key_granularity)
        transforms: Sequence[LayerTransform] = [
            LayerTransform.identity(shape.num_kv_heads, shape.head_dim, k_clip, v_clip) for _ in range(shape.num_layers)
        ]
    else:
        if layout is not None or key_bits is not None:
            raise ValueError("layout, key_bits: the artifact defines them; pass one or the other")
        art = _load_artifact(artifact)
        art.check_model(model.config)
        layout, transforms = art.layout, list(art.transforms)
        key_bits = tuple(getattr(art, "key_bits", ())) or None
    _check_layout(layout, transforms, shape)
    if decode_variant is not None and (ops.name != "triton" or layout.packing != "mma16"):
        raise ValueError(f"decode_variant {decode_variant!r}: picks the Triton kernel of mma16 pages; this setup has "
                         f"backend {ops.name!r} and {layout.packing!r} pages")
    if ops.name == "triton" and layout.packing == "mma16":  # v2 / v3: checked now, not at the first decode step
        from oscar_export.kernels import decode_attention_gl, decode_attention_v2

        device = next(model.parameters()).device
        if decode_variant is None:
            decode_variant, why = decode_attention_v2.default_variant(layout, shape.num_heads, device)
            if why:
                log.info("enable_oscar: mma16 pages decode with v2 'fields', not v3 'gluon': %s", why)
        if decode_variant not in decode_attention_v2.KERNELS:
            raise ValueError(f"decode_variant: expected one of {sorted(decode_attention_v2.KERNELS)}, "
                             f"got {decode_variant!r}")
        if any(b != layout.key.bits for b in key_bits or ()):
            raise NotImplementedError("backend 'triton': mma16 pages hold 2-bit keys only; 4-bit key layers use "
                                      "linear pages (the v1 kernel)")
        decode_attention_v2.check_decode_v2_layout(layout, shape.num_heads)
        if decode_variant == "gluon":
            decode_attention_gl.check_gluon_layout(layout, shape.num_heads,
                                                   bool(layout.key.codebook or layout.value.codebook))
            if device.type == "cuda":  # a model still on the CPU is checked at its first decode step
                decode_attention_gl.check_gluon_device(device)
    elif ops.name == "triton":  # what the GPU kernels refuse is refused now, not at the first decode step
        from oscar_export.kernels.decode_attention import check_decode_layout

        for bits in sorted(set(key_bits or (layout.key.bits,))):
            try:
                check_decode_layout(layout.with_key_bits(bits))
            except NotImplementedError as e:
                if bits == layout.key.bits:
                    raise
                raise NotImplementedError(f"backend 'triton': this artifact stores {bits}-bit keys in layers "
                                          f"{[i for i, b in enumerate(key_bits) if b == bits]}, which the Triton "
                                          f"kernels do not read yet ({e}); use backend='torch'") from e
    register_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    return OscarSetup(model, shape, layout, tuple(transforms), ops, previous, key_bits, decode_variant)


def cache_kwargs(model: Any, cache: OscarCache) -> dict[str, OscarCache]:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``: the keyword this transformers version uses."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def _check_layout(layout: KVCacheLayout, transforms: Sequence[LayerTransform], shape: AttentionShape) -> None:
    if (layout.num_kv_heads, layout.head_dim) != (shape.num_kv_heads, shape.head_dim):
        raise ValueError(
            f"layout: expected H_kv={shape.num_kv_heads}, D={shape.head_dim} (the model's), "
            f"got H_kv={layout.num_kv_heads}, D={layout.head_dim}"
        )
    if len(transforms) != shape.num_layers:
        raise ValueError(f"transforms: expected {shape.num_layers} (one per layer), got {len(transforms)}")
    for i, t in enumerate(transforms):
        if (t.num_kv_heads, t.head_dim) != (shape.num_kv_heads, shape.head_dim):
            raise ValueError(
                f"transforms[{i}]: expected H_kv={shape.num_kv_heads}, D={shape.head_dim}, "
                f"got H_kv={t.num_kv_heads}, D={t.head_dim}"
            )


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AttentionShape",
    "cache_kwargs",
    "OscarSetup",
    "enable_oscar",
    "model_attention_shape",
    "register_attention",
]
