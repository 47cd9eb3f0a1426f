"""The model fingerprint: what an artifact records of the model it was calibrated for, and must match.

The attention facts (heads, head_dim, scaling, RoPE) come from the model-family table
(:mod:`.families`); :func:`fingerprint_mismatches` lists what differs, :func:`parse_fingerprint` reads one from
untrusted JSON.
"""

from __future__ import annotations

from typing import Any

from .artifact_format import LIMITS, ArtifactError
from .families import family_for, rope_parameters
from .safe_json import json_int, json_keys, json_object, json_str

FINGERPRINT_KEYS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "vocab_size", "rope",
)
#: fingerprint keys compared when the artifact has them (artifacts written before they existed lack them).
OPTIONAL_FINGERPRINT_KEYS = ("attention_scaling",)

def jsonable(x: Any) -> Any:
    """Plain JSON types (floats stay floats, tuples become lists, keys sorted)."""
    if isinstance(x, dict):
        return {str(k): jsonable(x[k]) for k in sorted(x, key=str)}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, float):
        return float(x)
    return str(x)


def text_config(config: Any) -> Any:
    """The config of the language model (``model.config`` or a multimodal config's text part)."""
    config = getattr(config, "config", config)  # a model was passed
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def model_fingerprint(config: Any) -> dict[str, Any]:
    """What an artifact must match: architecture, layers, heads, head_dim, scale, widths and RoPE parameters.

    The attention facts come from the model-family table (``families.family_for``: raises its
    ``NotImplementedError`` for a model the cache cannot serve).

    Args:
        config: a Hugging Face ``PretrainedConfig`` (or a model; its ``.config`` is used).
    """
    c = text_config(config)
    f = family_for(c)
    archs = getattr(c, "architectures", None) or []
    return jsonable({
        "model_type": f.model_type,
        "architecture": archs[0] if archs else None,
        "num_hidden_layers": f.num_layers,
        "num_attention_heads": f.num_heads,
        "num_key_value_heads": f.num_kv_heads,
        "head_dim": f.head_dim,
        "attention_scaling": f.scaling,
        "hidden_size": int(c.hidden_size),
        "vocab_size": int(getattr(c, "vocab_size", 0) or 0),
        "rope": rope_parameters(c),
        "name": getattr(c, "_name_or_path", None) or getattr(c, "_model_name_or_path", None),
    })


def fingerprint_mismatches(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """``["num_hidden_layers: artifact 30, model 24", ...]`` for every key of :data:`FINGERPRINT_KEYS` that differs
    (and of :data:`OPTIONAL_FINGERPRINT_KEYS` that the artifact records)."""
    keys = FINGERPRINT_KEYS + tuple(k for k in OPTIONAL_FINGERPRINT_KEYS if k in expected)
    return [
        f"{k}: artifact {expected.get(k)!r}, model {got.get(k)!r}"
        for k in keys
        if jsonable(expected.get(k)) != jsonable(got.get(k))
    ]

def parse_fingerprint(x: Any, where: str = "fingerprint") -> dict[str, Any]:
    """A fingerprint from untrusted JSON: required keys, JSON types and :data:`LIMITS` checked."""
    L = LIMITS
    fp = json_object(x, where)
    json_keys(fp, where, FINGERPRINT_KEYS)
    json_str(fp["model_type"], f"{where}.model_type")
    for key in ("architecture", "name"):
        if key in fp:
            json_str(fp[key], f"{where}.{key}", limit=4096, optional=True)
    json_int(fp["num_hidden_layers"], f"{where}.num_hidden_layers", 1, L.max_layers)
    json_int(fp["num_key_value_heads"], f"{where}.num_key_value_heads", 1, L.max_kv_heads)
    heads = json_int(fp["num_attention_heads"], f"{where}.num_attention_heads", 1, L.max_heads)
    if heads % fp["num_key_value_heads"]:
        raise ArtifactError(f"{where}.num_attention_heads: expected a multiple of num_key_value_heads = "
                            f"{fp['num_key_value_heads']}, got {heads}")
    json_int(fp["head_dim"], f"{where}.head_dim", 1, L.max_head_dim)
    json_int(fp["hidden_size"], f"{where}.hidden_size", 1, L.max_hidden_size)
    json_int(fp["vocab_size"], f"{where}.vocab_size", 0, L.max_vocab_size)
    json_object(fp["rope"], f"{where}.rope", optional=True)
    return fp


__all__ = ["FINGERPRINT_KEYS", "OPTIONAL_FINGERPRINT_KEYS", "fingerprint_mismatches", "jsonable", "model_fingerprint",
           "parse_fingerprint", "text_config"]
