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


def _llama_gguf(path, rows: int = 64) -> None:
    """A small llama GGUF: a header and one fp32 tensor of ``rows`` x 32."""
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((rows, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_truncated_gguf_is_named_damaged(tmp_path, monkeypatch):
    """Cut short in its tensor data, or in its header: one ValueError naming the file, before any tensor is read
    (numpy's ``cannot reshape array of size ...`` named neither)."""
    path = tmp_path / "m.gguf"
    _llama_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    monkeypatch.setattr(models, "default_model_dir", lambda: (tmp_path, "m.gguf"))
    with pytest.raises(ValueError, match=rf"{path}: the GGUF file is damaged: {len(data) - 100:,} bytes, its tensor "
                                         rf"table needs {len(data):,}"):
        models.load_model(models.DEFAULT_MODEL)
    path.write_bytes(data)
    models.check_gguf(str(path))
    path.write_bytes(data[:40])
    with pytest.raises(ValueError, match=rf"{path}: the GGUF file is damaged: its header cannot be read"):
        models.gguf_config(str(path))


@pytest.mark.parametrize("value", [0, -64, True, 16.0])
def test_a_model_config_with_a_bad_size_is_one_line(tmp_path, capsys, value):
    """``head_dim: 0`` divided by zero inside transformers (generate) or was read as hidden / heads (calibrate)."""
    import json
    import re

    from oscar_export.cli import main

    from helpers import one_line, tiny_model

    d = tmp_path / "m"
    tiny_model().save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "head_dim": value}))
    want = f"{d / 'config.json'}: " + ("head_dim: expected a positive int, got" if type(value) is int else
                                        "transformers cannot read this config (Validation error for field 'head_dim'")
    with pytest.raises(ValueError, match=re.escape(want)):
        models.load_model(str(d))
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["generate", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    assert want in one_line(capsys.readouterr().err, "generate")
    assert main(["calibrate", "--model", str(d), "--out", str(tmp_path / "a"), "--quiet"]) == 2
    assert want in one_line(capsys.readouterr().err, "calibrate")
