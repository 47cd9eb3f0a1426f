"""The exported checkpoint's schema: what ``oscar-export export`` writes and every reader of it expects.

An exported checkpoint is a Hugging Face checkpoint whose value projections already carry the value transform
(``export.fold_value_transforms``), with the OSCAR artifact inside it::

    ckpt/config.json          the model config plus an "oscar" section (:func:`oscar_section`):
                                  {"format_version": 1, "artifact": "oscar_artifact", "values_prerotated": true,
                                   "layout": {...KVCacheLayout.to_dict()...}, "key_bits": [2, 4, ...],
                                   "fingerprint": {...}, "source_model": "default"}
    ckpt/model.safetensors    the folded weights (or shards named by model.safetensors.index.json)
    ckpt/tokenizer*           the tokenizer
    ckpt/oscar_artifact/      the artifact (oscar.json, rotations.safetensors), values_prerotated=True

Writers: :func:`write_checkpoint` (inside ``export``'s atomic transaction). Readers: ``build``, ``generate``,
``tensor_parallel``, ``plugins/trtllm/deployment.py``; each reads ``config.json`` with the artifact loader's
bounds (size, strict JSON, nesting) and finds the artifact through :func:`artifact_path`, which refuses a
directory outside the checkpoint.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from oscar_export.calibration.artifact_format import LIMITS
from oscar_export.calibration.safe_json import parse_json, printable

#: the ``format_version`` of the ``config.json`` ``"oscar"`` section this module writes and reads
OSCAR_SECTION_VERSION = 1
#: the artifact's directory inside the checkpoint
ARTIFACT_DIR = "oscar_artifact"


# ---- write -------------------------------------------------------------------------------------------------------


def oscar_section(artifact, source: str) -> dict[str, Any]:
    """The ``config.json`` ``"oscar"`` section: where the artifact is and what the checkpoint already does."""
    return {
        "format_version": OSCAR_SECTION_VERSION,
        "artifact": ARTIFACT_DIR,
        "values_prerotated": True,
        "layout": artifact.layout.to_dict(),
        "key_bits": list(artifact.key_bits),
        "fingerprint": artifact.fingerprint,
        "source_model": source,
    }


def write_checkpoint(directory: Path, model, tokenizer, artifact, source: str) -> None:
    """Write a folded ``model`` (its config with the ``"oscar"`` section), ``tokenizer`` (None: none) and
    ``artifact`` (marked ``values_prerotated`` here) into the existing, empty ``directory``."""
    model.config.oscar = oscar_section(artifact, source)
    try:
        with plain_float_model(model):
            model.save_pretrained(directory)
    finally:
        del model.config.oscar
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    artifact.with_values_prerotated(True).save(directory / ARTIFACT_DIR)


def gguf_dequantized(model) -> bool:
    """True when the model came from a GGUF file (transformers dequantizes it to float on load).

    Raises:
        NotImplementedError: a model quantized another way (its weights are not plain floats to fold).
    """
    q = getattr(model, "hf_quantizer", None)
    if q is None:
        return False
    method = getattr(getattr(q, "quantization_config", None), "quant_method", None)
    method = str(getattr(method, "value", method))
    if method != "gguf":
        raise NotImplementedError(f"export: models quantized with {method!r} cannot be folded; load them in float")
    return True


@contextlib.contextmanager
def plain_float_model(model) -> Iterator[None]:
    """Save a GGUF-loaded model as the plain float model it is (no quantizer, no quantization_config)."""
    if not gguf_dequantized(model):
        yield
        return
    quantizer = model.hf_quantizer
    qc = model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if qc is not None:
            model.config.quantization_config = qc


# ---- read --------------------------------------------------------------------------------------------------------


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file of a checkpoint, read with the artifact loader's bounds (size, strict JSON, nesting)."""
    size = path.stat().st_size
    if size > LIMITS.max_meta_bytes:
        raise ValueError(f"{printable(path)}: expected at most {LIMITS.max_meta_bytes:,} bytes, got {size:,}")
    data = parse_json(path.read_bytes(), printable(path))
    if not isinstance(data, dict):
        raise ValueError(f"{printable(path)}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config_json(ckpt: str | Path) -> dict[str, Any]:
    """``ckpt/config.json`` as a dict, read with the artifact loader's bounds (size, strict JSON, nesting)."""
    cfg = Path(ckpt) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{printable(ckpt)}: not a Hugging Face checkpoint (no config.json)")
    return read_json_object(cfg)


def artifact_path(ckpt: str | Path, section: dict[str, Any]) -> Path:
    """The bundled artifact's directory, refused unless it lies inside ``ckpt`` (after resolving links)."""
    ckpt = Path(ckpt)
    rel = section.get("artifact")
    if not isinstance(rel, str) or not rel:
        raise ValueError(f"{printable(ckpt / 'config.json')}: oscar.artifact: expected a relative directory name, "
                         f"got {printable(repr(rel), 80)}")
    path = ckpt / rel
    real, base = path.resolve(), ckpt.resolve()
    if Path(rel).is_absolute() or not real.is_relative_to(base) or real == base:
        raise ValueError(f"{printable(ckpt / 'config.json')}: the artifact {printable(rel, 120)!r} is outside the "
                         f"checkpoint (resolves to {printable(real)}); it must be a directory inside {printable(base)}")
    return path


def read_export(ckpt: str | Path) -> dict[str, Any]:
    """The ``oscar`` section of an exported checkpoint's config (raises if ``ckpt`` is not one)."""
    ckpt = Path(ckpt)
    section = read_config_json(ckpt).get("oscar")
    cfg = ckpt / "config.json"
    if not isinstance(section, dict) or section.get("format_version") != OSCAR_SECTION_VERSION:
        raise ValueError(f"{cfg}: no 'oscar' section of format {OSCAR_SECTION_VERSION}; run `oscar-export export` "
                         "first")
    if not (artifact_path(ckpt, section) / "oscar.json").is_file():
        raise FileNotFoundError(f"{ckpt}: the OSCAR artifact {section['artifact']}/ is missing")
    return section


def load_exported_artifact(ckpt: str | Path, section: dict[str, Any], model_config=None):
    """The checkpoint's artifact (``load_artifact``: loaded and verified in full, checked against
    ``model_config`` when given), refused unless every layer is ``values_prerotated``."""
    from oscar_export.calibration.artifact import load_artifact

    artifact = load_artifact(artifact_path(ckpt, section), model_config)
    if not all(t.values_prerotated for t in artifact.transforms):
        raise ValueError(f"{ckpt}: the bundled artifact is not marked values_prerotated (not an export?)")
    return artifact


def checkpoint_tensors(ckpt: str | Path, names: Any = None) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's ``model.safetensors`` (or its shards, ``model.safetensors.index.json``),
    all of them or those whose name is in ``names``."""
    from safetensors import safe_open

    ckpt = Path(ckpt)
    index = ckpt / "model.safetensors.index.json"
    files = sorted(set(read_json_object(index)["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(ckpt / name), framework="pt") as f:
            for k in f.keys():
                if names is None or k in names:
                    out[k] = f.get_tensor(k)
    return out


def load_exported(ckpt: str | Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer, artifact)`` of an exported checkpoint; the artifact has ``values_prerotated=True``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    section = read_export(ckpt)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
    artifact = load_exported_artifact(ckpt, section, model.config)
    return model, AutoTokenizer.from_pretrained(str(ckpt)), artifact


__all__ = [
    "ARTIFACT_DIR", "OSCAR_SECTION_VERSION", "artifact_path", "checkpoint_tensors", "gguf_dequantized",
    "load_exported", "load_exported_artifact", "oscar_section", "plain_float_model", "read_config_json",
    "read_export", "read_json_object", "write_checkpoint",
]
