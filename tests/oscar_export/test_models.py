"""``oscar_export.models``: the embedded GGUF parsed once, into transformers' own config and tokenizer."""

from __future__ import annotations

import pytest

from oscar_export import models

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_file() -> tuple[str, str]:
    try:
        folder, name = models.default_model_dir()
    except ImportError as e:
        pytest.skip(str(e))
    return str(folder), name


@pytest.mark.model
def test_default_model_parses_the_gguf_once(gguf_file, monkeypatch):
    """transformers' whole-file parse (``gguf.GGUFReader``, ~2.5 s on 2 cores) ran for the config, the weights and
    the tokenizer's class: once, for the weights, is enough."""
    parses = []

    class Counting(gguf.GGUFReader):
        def __init__(self, *a, **k):
            parses.append(a[0] if a else k)
            super().__init__(*a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    model, tok = models.load_model(models.DEFAULT_MODEL)
    assert len(parses) == 1, f"the GGUF was parsed {len(parses)} times: {parses}"
    assert model.config.num_hidden_layers == 30 and tok.pad_token is not None


@pytest.mark.model
def test_config_and_tokenizer_are_what_transformers_builds(gguf_file):
    """The header's config equals the legacy parse's and the tokenizer class is AutoTokenizer's pick, with the same
    vocabulary, special tokens and chat template: the model and its artifacts stay the same to the bit."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = gguf_file
    want = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    got = models.gguf_config(f"{folder}/{name}").to_dict()
    for d in (want, got):  # the folder: from_pretrained sets it on the model's config whichever config it is given
        d.pop("_name_or_path")
    diff = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
    assert not diff, f"config differs (ours, transformers'): {diff}"

    auto = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    auto.pad_token = auto.pad_token or auto.eos_token
    tok = models.load_tokenizer(models.DEFAULT_MODEL)
    assert type(auto).__name__ == models.GGUF_TOKENIZER and type(tok) is type(auto)
    assert tok.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert tok.init_kwargs == auto.init_kwargs and tok.special_tokens_map == auto.special_tokens_map
    assert tok.chat_template == auto.chat_template
    text = "def f(x):\n    return x ** 2  # ünïcode <|im_start|>user\nhi<|im_end|>"
    assert tok(text).input_ids == auto(text).input_ids


def test_gguf_config_refuses_an_architecture_it_does_not_read(tmp_path):
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError, match="expected a llama GGUF, got architecture 'gpt2'"):
        models.gguf_config(str(path))
