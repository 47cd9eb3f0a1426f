"""Which Hugging Face models the OSCAR cache supports, and ``enable_oscar``: the one entry point.

Supported: the families of the model-family table (``calibration/families.py``: Llama, Mistral, Mixtral,
Qwen2, Qwen3, Qwen3-MoE, GLM-4, GLM-4-MoE, Gemma 3 text) with full attention in every layer, except Gemma 3,
whose interleaved sliding-window layers keep their window in a plain model-dtype cache (``sliding.py``). Their attention
modules apply RoPE (and q/k norms) before ``cache.update``, so the cache and the attention function see exactly
the post-RoPE keys and queries docs/design.md §4 asks for. Anything else raises the table's ``NotImplementedError``
naming the architecture or the feature.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from oscar_export.calibration.families import FAMILIES, ModelAttention, family_for
from oscar_export.kernels.checks import check_portable_layout
from oscar_export.kernels.decode import DecodeBackend
from oscar_export.kernels.decode.backend import backends_by_width, have_triton
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

from . import precompile
from .attention import ATTENTION_NAME, oscar_attention, oscar_mask
from .cache import OscarCache
from .ops import CacheOps, get_ops

log = logging.getLogger(__name__)

#: ``config.model_type`` values the cache supports (the family table's keys).
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

#: What the cache needs to know about a model's attention (L, H, H_kv, D, scale, ...): the family table's resolved
#: facts (``calibration.families.family_for``, which refuses a model the table does not support, naming why).
AttentionShape = ModelAttention


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
    #: each layer's decode backend (``kernels.decode.select_backend``), which fixes its page packing
    decode_backends: tuple[DecodeBackend, ...] | None = None
    #: the hook that gives a forward without ``position_ids`` its positions from the cache (:func:`cache_positions`)
    positions_hook: Any = None

    def make_cache(self, batch_size: int, max_length: int) -> OscarCache:
        """A fresh cache for ``batch_size`` sequence slots of up to ``max_length`` tokens each (prompt +
        generated); every page they can need is reserved now. Windows take the model's dtype and device."""
        p = next(self.model.parameters())
        cache = OscarCache(self.layout, self.transforms, batch_size, max_length, device=p.device, dtype=p.dtype,
                           backend=self.ops, sliding_layers=self.shape.sliding_layers,
                           sliding_window=self.shape.sliding_window, key_bits=self.key_bits,
                           decode_backends=self.decode_backends, num_heads=self.shape.num_heads)
        cache.owner = weakref.ref(self.model.base_model)
        limit = max_positions(self.model)
        if limit is not None and max_length > limit:
            warnings.warn(f"make_cache: max_length {max_length} exceeds the model's max_position_embeddings {limit}; "
                          f"a prompt past {limit} positions is refused", stacklevel=2)
        if self.ops.name == "triton" and p.is_cuda:  # the decode step's kernels, compiled in worker processes
            cache.precompile = precompile.start(precompile.formats(cache, self.shape.scaling), p.device)
        return cache

    def restore(self) -> None:
        """Switch the model back to the attention implementation it had before ``enable_oscar``."""
        self.model.set_attn_implementation(self.previous_attn_implementation)
        if self.positions_hook is not None:
            self.positions_hook.remove()

    def __enter__(self) -> "OscarSetup":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def resolve_backend(model: Any, backend: str | CacheOps) -> str | CacheOps:
    """``"auto"`` -> ``"triton"`` for a BF16 model on CUDA when Triton imports, else ``"torch"``."""
    if backend != "auto":
        return backend
    p = next(model.parameters())
    if p.is_cuda and p.dtype == torch.bfloat16 and have_triton():
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
    Returns:
        an :class:`OscarSetup`; ``setup.make_cache(batch_size, max_length)`` gives the cache to pass as
        ``past_key_values``.
    """
    shape = family_for(model)
    if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME:
        raise ValueError("enable_oscar: this model is on the OSCAR attention already (an earlier enable_oscar's setup "
                         "was not restored); call restore() on that setup first, or use it")
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
    backends = _decode_backends(model, ops, layout, key_bits, shape)
    register_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    hook = model.base_model.register_forward_pre_hook(cache_positions, with_kwargs=True)
    return OscarSetup(model, shape, layout, tuple(transforms), ops, previous, key_bits, backends, hook)


def _decode_backends(model: Any, ops: CacheOps, layout: KVCacheLayout, key_bits: tuple[int, ...] | None,
                     shape: AttentionShape) -> tuple[DecodeBackend, ...]:
    """Each layer's decode backend (``select_backend`` on the model's device; the Triton ops take the portable
    kernel where it says "reference", e.g. a model still on the CPU), checked now, not at the first decode step:
    a layout the chosen kernel does not read raises here."""
    device = next(model.parameters()).device
    bits = key_bits or (layout.key.bits,) * shape.num_layers
    if ops.name != "triton":
        return tuple(DecodeBackend("reference", f"backend {ops.name!r}") for _ in bits)
    chosen = backends_by_width(layout, bits, device, shape.num_heads)
    for b, backend in list(chosen.items()):
        lay = layout.with_packing("linear").with_key_bits(b)
        if backend.name == "reference":
            backend = DecodeBackend("portable", backend.why)
        if backend.name == "portable":
            try:
                check_portable_layout(lay)
            except NotImplementedError as e:
                layers = [i for i, x in enumerate(bits) if x == b]
                raise NotImplementedError(f"backend 'triton': layers {layers} ({b}-bit keys) have a format the "
                                          f"Triton kernels do not read ({e}); use backend='torch'") from e
            if device.type == "cuda":
                log.info("enable_oscar: %d-bit key layers decode with the portable kernel: %s", b, backend.why)
        chosen[b] = backend
    return tuple(chosen[b] for b in bits)


def cache_positions(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the decoder (``enable_oscar`` registers it): a forward with an :class:`OscarCache`
    and no ``position_ids`` gets each row's positions from its slot's length, not from the columns the cache
    has seen (transformers' default), so a slot refilled with ``reset_sequence`` + ``select`` and the slots
    beside it keep their own positions. A decode step reads the lengths on the device (no sync);
    a prompt reads them on the host (as it does anyway), padding columns taking no position.

    Outside a compiled step it also refuses (:func:`check_positions`) a cache another model's setup made, a prompt
    past ``max_position_embeddings``, and given ``position_ids`` that do not continue the slots' stored tokens (a
    prompt; a decode step where they are on the CPU: on a GPU that check would synchronise every step)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, OscarCache):
        return None
    checked = not torch.compiler.is_compiling()  # host checks outside a compiled step (it has no host code)
    if checked and cache.owner is not None and cache.owner() is not module:
        raise ValueError("cache: made by another model's enable_oscar setup (its pages hold that model's keys and "
                         "values); make one with this model's setup.make_cache")
    x = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if x is None and args:
        x = args[0]
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        return None
    t, device, given = x.shape[1], cache.book.device, kwargs.get("position_ids")
    decode = t == 1 and len(cache.active_slots) == cache.book.batch
    if given is not None and not (checked and (not decode or not given.is_cuda)):
        return None  # nothing to fill, nothing checked: a compiled step, or a CUDA decode step (it would synchronise)
    real = None
    if decode:
        positions = cache.book.seq_len[:, None].to(torch.long)
    else:
        lengths = cache.book.seq_len.tolist()
        starts = torch.tensor([lengths[s] for s in cache.active_slots], dtype=torch.long, device=device)[:, None]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[0] == starts.shape[0]:
            real = mask[:, -t:].to(device=device, dtype=torch.long)
            positions = starts + (real.cumsum(-1) - 1).clamp_min(0)
        else:
            positions = starts + torch.arange(t, device=device)
    if checked and (given is not None or not decode):
        check_positions(module, positions, given, real)
    if given is not None:
        return None
    return args, {**kwargs, "position_ids": positions.to(x.device)}


def max_positions(model: Any) -> int | None:
    """The model's ``max_position_embeddings`` (of its text config), or None where it states none."""
    config = getattr(model, "config", model)
    c = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    limit = getattr(c, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def check_positions(module: Any, positions: torch.Tensor, given: torch.Tensor | None,
                    real: torch.Tensor | None) -> None:
    """Raise unless a forward's positions continue each slot's stored tokens (``positions``, ``[rows, T]``, from the
    slots' lengths; ``given``: the caller's ``position_ids``, compared on the real columns ``real`` of a padded
    batch) and stay within the model's ``max_position_embeddings``."""
    keep = torch.ones_like(positions, dtype=torch.bool) if real is None else real.bool()
    if given is not None and given.ndim == 2 and given.shape[0] in (1, positions.shape[0]) \
            and given.shape[1] == positions.shape[1]:  # another shape: the attention's own check names it
        got = given.to(positions.device, torch.long).expand_as(positions)
        bad = (got != positions) & keep
        if bool(bad.any()):
            r, c = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"position_ids: row {r} column {c} is {int(got[r, c])}, expected {int(positions[r, c])}: "
                             f"that row's cache slot holds {int(positions[r, c]) - int(keep[r, :c].sum())} tokens; "
                             f"leave position_ids out (the cache gives them) or reset_sequence the slot")
    limit = max_positions(module)
    if limit is not None and bool((keep & (positions >= limit)).any()):
        top = int(positions[keep].max()) + 1
        raise ValueError(f"this forward reaches position {top}, past the model's max_position_embeddings {limit}; "
                         f"shorten the prompt (or the cache's max_length)")


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
    "register_attention",
]
