"""The model families the OSCAR cache serves, decided in one place (docs/design.md §2 "model-family table").

Every consumer — ``enable_oscar``, calibration capture, export's weight folding, ``build``, the TensorRT-LLM
adapter and evaluation — asks :func:`family_for` and reads the returned :class:`ModelAttention`; nothing else
inspects a Hugging Face config for heads, head_dim, attention scaling, RoPE, norms, biases or sliding
windows. Two fact sets, one dataclass each:

* :class:`Family` — what is fixed for a ``config.model_type`` (how its attention module is built, read from
  transformers' modeling files): the scaling rule, the RoPE pairing, whether q/k norms and biases exist
  (always, never, or per a config flag), how sliding-window layers are declared, and where export finds the
  projections it folds (:class:`FoldSpec`).
* :class:`ModelAttention` — those facts resolved for one config: L, H, H_kv, D, the softmax scale, rotary
  dimension, norms, biases, sliding-window layers.

Every family listed applies its q/k norms and RoPE *before* ``cache.update`` (checked in transformers
5.17 and 5.24), so the cache and the attention function receive post-RoPE keys (docs/design.md §4). The attention
scale at run time is the ``scaling`` transformers passes to the attention function; the family's rule
(:attr:`ModelAttention.scaling`) is what offline consumers (``build``'s kernel bundle, calibration when no
scale is passed) use, and calibration checks the two agree.

Unsupported, with one ``NotImplementedError`` naming the architecture or the feature: any other
``model_type``, attention logit soft-capping, multi-head latent attention (``kv_lora_rank``), a RoPE type
outside :data:`ROPE_TYPES`, bidirectional attention, and sliding-window layers except Gemma 3's interleaved
local layers (:attr:`Family.keeps_sliding_layers`: they keep their short window in a plain BF16 sliding cache
beside the OSCAR one, ``plugins/hf/sliding.py``, and get identity transforms from calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: RoPE types (``rope_parameters["rope_type"]``) whose rotation transformers applies before ``cache.update``
#: and that the table has been checked against.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

#: a ``Family`` flag: a bool (always / never) or the name of the config attribute that decides it.
Flag = bool | str


@dataclass(frozen=True)
class FoldSpec:
    """Where export finds what it folds: ``model.<layers>[i].<attention>.<v_proj | o_proj>``.

    ``o_proj`` takes its input as ``[H * D]`` with query head ``j`` in columns ``j*D : (j+1)*D`` and query
    head ``j`` reading KV head ``j // (H / H_kv)`` (transformers' ``repeat_kv``): ``o_proj_layout="head_major"``.
    """

    layers: str = "model.layers"
    attention: str = "self_attn"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    o_proj_layout: str = "head_major"

    def __post_init__(self) -> None:
        if self.o_proj_layout != "head_major":
            raise ValueError(f"FoldSpec.o_proj_layout: expected 'head_major', got {self.o_proj_layout!r}")


@dataclass(frozen=True)
class Family:
    """Attention facts fixed for one ``model_type`` (see the module doc).

    Args:
        name: human name (``"Llama"``).
        scaling: ``"head_dim"`` (``D ** -0.5``) or ``"query_pre_attn_scalar"``
            (``config.query_pre_attn_scalar ** -0.5``).
        rope_interleaved: RoPE pairs ``(2i, 2i+1)`` (GLM) instead of ``(i, i + r/2)`` (``rotate_half``).
        qk_norm: RMS norms on q and k per head, before RoPE.
        qkv_bias, o_bias: biases of q/k/v_proj and of o_proj.
        sliding: how sliding-window layers are declared: ``"none"``, ``"all"`` (``config.sliding_window`` not
            None slides every layer: Mistral, Mixtral, Qwen3-MoE) or ``"layer_types"`` (layers whose
            ``config.layer_types`` entry is ``"sliding_attention"``, window ``config.sliding_window``).
        keeps_sliding_layers: the cache holds this family's sliding layers in a plain BF16 sliding cache beside
            the OSCAR one (``plugins/hf/sliding.py``; calibration gives them identity transforms). Gemma 3 only:
            its local layers interleave with global ones; a model whose every layer slides has nothing to keep.
        moe: the MLP is a mixture of experts (attention unchanged; informational).
        trtllm: ``(upstream module, model class)`` that the TensorRT-LLM adapter subclasses to serve this
            family (``plugins/trtllm``), None where it serves none.
    """

    name: str
    scaling: str = "head_dim"
    rope_interleaved: bool = False
    qk_norm: Flag = False
    qkv_bias: Flag = "attention_bias"
    o_bias: Flag = "attention_bias"
    sliding: str = "none"
    keeps_sliding_layers: bool = False
    moe: bool = False
    fold: FoldSpec = field(default_factory=FoldSpec)
    trtllm: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.scaling not in ("head_dim", "query_pre_attn_scalar"):
            raise ValueError(f"Family.scaling: expected 'head_dim' or 'query_pre_attn_scalar', got {self.scaling!r}")
        if self.sliding not in ("none", "all", "layer_types"):
            raise ValueError(f"Family.sliding: expected 'none', 'all' or 'layer_types', got {self.sliding!r}")


#: ``config.model_type`` -> family. Attention modules checked in transformers 5.17 and 5.24.
FAMILIES: dict[str, Family] = {
    # SmolLM2, Llama 2/3.x (rope_type "llama3")
    "llama": Family("Llama", trtllm=("tensorrt_llm._torch.models.modeling_llama", "LlamaForCausalLM")),
    "mistral": Family("Mistral", qkv_bias=False, o_bias=False, sliding="all"),
    "mixtral": Family("Mixtral", qkv_bias=False, o_bias=False, sliding="all", moe=True),
    "qwen2": Family("Qwen2", qkv_bias=True, o_bias=False, sliding="layer_types"),
    "qwen3": Family("Qwen3", qk_norm=True, sliding="layer_types"),
    "qwen3_moe": Family("Qwen3-MoE", qk_norm=True, sliding="all", moe=True),
    "glm4": Family("GLM-4", rope_interleaved=True, o_bias=False),
    "glm4_moe": Family("GLM-4-MoE", qk_norm="use_qk_norm", o_bias=False, moe=True),
    "gemma3_text": Family("Gemma 3", scaling="query_pre_attn_scalar", qk_norm=True, sliding="layer_types",
                          keeps_sliding_layers=True),
}


@dataclass(frozen=True)
class ModelAttention:
    """A family's facts resolved for one config: what every consumer reads.

    ``rope`` is the config's RoPE parameters (one dict, or one per layer type for Gemma 3) as JSON;
    ``rotary_dim`` the leading dimensions RoPE rotates (``D * partial_rotary_factor``; GLM: ``D / 2``).
    ``sliding_layers`` lists the layers with a sliding window of ``sliding_window`` tokens (non-empty only for a
    family that keeps them: Gemma 3).
    """

    model_type: str
    family: Family
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    rope: dict[str, Any]
    rotary_dim: int
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (``H / H_kv``)."""
        return self.num_heads // self.num_kv_heads


def _config_of(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def architecture_name(model_or_config: Any) -> str:
    """``"Qwen2ForCausalLM"``: the model's class, else the config's first architecture, else the config class."""
    config = _config_of(model_or_config)
    if config is not model_or_config:
        return type(model_or_config).__name__
    return (getattr(config, "architectures", None) or [type(config).__name__])[0]


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters (transformers 5 ``rope_parameters``, or the 4.x ``rope_theta``/``rope_scaling``)."""
    rope = getattr(config, "rope_parameters", None)
    if rope is None:
        rope = {"rope_theta": getattr(config, "rope_theta", None),
                "rope_scaling": getattr(config, "rope_scaling", None)}
    return dict(rope)


def _rope_sets(config: Any) -> list[dict[str, Any]]:
    """One dict per RoPE setting: Gemma 3 keeps one per layer type (``{"full_attention": {...}, ...}``)."""
    rope = rope_parameters(config)
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    if "rope_scaling" in rope and "rope_type" not in rope:  # transformers 4 style
        scaling = rope.get("rope_scaling") or {}
        return [{"rope_type": scaling.get("rope_type", scaling.get("type", "default")), **scaling}]
    return [rope]


def _flag(config: Any, flag: Flag) -> bool:
    return bool(getattr(config, flag, False)) if isinstance(flag, str) else flag


def _unsupported(model_or_config: Any, what: str) -> NotImplementedError:
    """``OSCAR: architecture 'X' (model_type 'x') <what>``: the one message every stage gives."""
    mt = getattr(_config_of(model_or_config), "model_type", None)
    return NotImplementedError(f"OSCAR: architecture {architecture_name(model_or_config)!r} (model_type {mt!r}) {what}")


def family_for(model_or_config: Any) -> ModelAttention:
    """The attention facts of a Hugging Face model or config, or one ``NotImplementedError`` saying why not.

    Raises:
        NotImplementedError: the architecture is not in :data:`FAMILIES`, or the config uses attention logit
            soft-capping, multi-head latent attention, bidirectional attention, a RoPE type outside
            :data:`ROPE_TYPES`, or sliding-window layers. The message names the architecture and the feature
            (``enable_oscar``, ``calibrate``, ``export`` and ``build`` all raise this one).
        ValueError: a config whose head counts do not fit together.
    """
    c = _config_of(model_or_config)
    mt = getattr(c, "model_type", None)
    if getattr(c, "kv_lora_rank", None):
        raise _unsupported(model_or_config, f"uses multi-head latent attention (MLA, kv_lora_rank="
                           f"{c.kv_lora_rank}); the OSCAR cache stores per-head keys and values only")
    if getattr(c, "attn_logit_softcapping", None):
        raise _unsupported(model_or_config, f"uses attention logit soft-capping (attn_logit_softcapping="
                           f"{c.attn_logit_softcapping}); the OSCAR attention does not support it")
    fam = FAMILIES.get(mt)
    if fam is None:
        raise _unsupported(model_or_config, f"is not supported; supported model types: {', '.join(FAMILIES)}")
    if getattr(c, "use_bidirectional_attention", False):
        raise _unsupported(model_or_config, "uses bidirectional attention; the OSCAR cache is causal only")

    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    if heads % kv_heads:
        raise ValueError(
            f"{mt} config: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if fam.scaling == "query_pre_attn_scalar":
        scaling = float(c.query_pre_attn_scalar) ** -0.5
    else:
        scaling = float(head_dim) ** -0.5

    rotary = set()
    for r in _rope_sets(c):
        kind = r.get("rope_type", r.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise _unsupported(
                model_or_config, f"uses RoPE type {kind!r}; supported RoPE types: {', '.join(ROPE_TYPES)}"
            )
        factor = r.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None) or 1.0)
        rotary.add(int(head_dim * float(factor)))
    if len(rotary) != 1:
        raise _unsupported(model_or_config, f"rotates different dimensions per layer type ({sorted(rotary)})")

    sliding, window = _sliding_layers(model_or_config, fam)
    if sliding and fam.keeps_sliding_layers and len(sliding) == int(c.num_hidden_layers):
        raise _unsupported(model_or_config, f"has sliding-window attention in every layer (sliding_window={window}); "
                           "the OSCAR cache keeps the global layers, and there are none")
    if sliding and not fam.keeps_sliding_layers:
        shown = ", ".join(map(str, sliding[:8])) + (", ..." if len(sliding) > 8 else "")
        raise _unsupported(
            model_or_config,
            f"has sliding-window attention in {len(sliding)} of {c.num_hidden_layers} layers ({shown}; "
            f"sliding_window={window}); only full-attention layers are supported",
        )
    return ModelAttention(
        model_type=mt, family=fam, num_layers=int(c.num_hidden_layers), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, scaling=scaling, rope=rope_parameters(c), rotary_dim=rotary.pop(),
        qk_norm=_flag(c, fam.qk_norm), qkv_bias=_flag(c, fam.qkv_bias), o_bias=_flag(c, fam.o_bias),
        sliding_layers=tuple(sliding), sliding_window=window,
    )


def family_for_pretrained(directory: Any) -> ModelAttention:
    """:func:`family_for` of a local checkpoint directory's ``config.json``, without loading any weights."""
    from transformers import AutoConfig

    return family_for(AutoConfig.from_pretrained(str(directory)))


def family_for_config_dict(config: dict[str, Any]) -> ModelAttention:
    """:func:`family_for` of a ``config.json`` already read as a dict (a deployment's checkpoint). The dict is
    turned into its transformers config class first, so a value the file leaves out takes the class default the
    model was built with (e.g. Gemma 3's ``head_dim`` 256, not ``hidden_size // heads``)."""
    from transformers import AutoConfig

    mt = config.get("model_type")
    if mt not in FAMILIES:
        raise _unsupported(_ConfigName(config), f"is not supported; supported model types: {', '.join(FAMILIES)}")
    cls = type(AutoConfig.for_model(mt))
    return family_for(cls.from_dict({k: v for k, v in config.items() if k != "model_type"}))


@dataclass(frozen=True)
class _ConfigName:
    """Enough of a config for :func:`_unsupported` to name it."""

    d: dict

    @property
    def model_type(self):
        return self.d.get("model_type")

    @property
    def architectures(self):
        return self.d.get("architectures")


def _sliding_layers(model_or_config: Any, fam: Family) -> tuple[list[int], int | None]:
    """Indices of the layers with a sliding window, and that window (the rule of ``fam.sliding``)."""
    c = _config_of(model_or_config)
    window = getattr(c, "sliding_window", None)
    if fam.sliding == "none":  # its attention module reads neither sliding_window nor layer_types
        return [], None
    if fam.sliding == "all":
        layers = list(range(int(c.num_hidden_layers))) if window is not None else []
    else:
        layer_types = list(getattr(c, "layer_types", None) or [])
        other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if other:
            raise _unsupported(model_or_config, f"has layer types {other}; only full-attention layers are supported")
        layers = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    return layers, (window if layers else None)


__all__ = ["FAMILIES", "ROPE_TYPES", "Family", "FoldSpec", "ModelAttention", "architecture_name", "family_for",
           "family_for_config_dict", "family_for_pretrained", "rope_parameters"]
