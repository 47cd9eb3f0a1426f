"""``oscar-export generate`` on a tiny local model directory (and its user errors)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from oscar_export.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random-weight Llama (2 KV heads, D 16) with a word-level tokenizer ``w0 .. w93``, saved as an HF dir."""
    path = tmp_path_factory.mktemp("tiny_llama")
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(94)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", eos_token="[PAD]").save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, pad_token_id=0, eos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_generate_prints_both_outputs_and_bytes(tiny_dir, capsys):
    prompt = " ".join(f"w{i % 90}" for i in range(400))  # 400 tokens: INT2 pages with the default layout
    assert main(["generate", "--model", tiny_dir, "--prompt", prompt, "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "=== BF16 cache (DynamicCache) ===" in out and "=== OSCAR INT2 cache ===" in out
    assert "token agreement: " in out
    # 406 tokens in 2 layers, every number from the layout
    assert "KV cache at 406 tokens, 2 layers: BF16 103,936 bytes, OSCAR" in out
    assert "sink 64 + INT2 5 pages x 16 + recent 262 tokens" in out  # D = 16: pages of G = 16 tokens


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "w1", "--max-new-tokens", "0"], "--max-new-tokens: expected > 0, got 0"),
        (["--prompt-topic", "no-such-topic"], "--prompt-topic: unknown topic 'no-such-topic'"),
        (["--prompt", "w1", "--backend", "nope"], "backend: expected one of"),
        (["--prompt", "w1", "--artifact", "/nonexistent/artifact"], "artifact"),
    ],
)
def test_generate_user_errors_are_one_line(tiny_dir, capsys, argv, message):
    assert main(["generate", "--model", tiny_dir, "--device", "cpu", "--skip-bf16", *argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after any loading progress bars
    assert last.startswith("oscar-export generate: error: ") and message in last, last


def test_generate_rejects_a_missing_model_dir(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "expected 'default' or a local Hugging Face model directory" in capsys.readouterr().err
