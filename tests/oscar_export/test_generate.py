"""``oscar-export generate`` on a tiny local model directory (and its user errors)."""

from __future__ import annotations

import time

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
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", eos_token="[PAD]")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, pad_token_id=0,
                      eos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_generate_prints_both_outputs_and_bytes(tiny_dir, capsys, monkeypatch):
    import oscar_export.threads as threads_module

    monkeypatch.setattr(threads_module, "cpu_threads", lambda default: 1)  # as on a loaded machine
    threads = torch.get_num_threads()
    prompt = " ".join(f"w{i % 90}" for i in range(400))  # 400 tokens: INT2 pages with the default layout
    assert main(["generate", "--model", tiny_dir, "--prompt", prompt, "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "device: cpu  dtype: fp32  threads: 1" in out
    assert torch.get_num_threads() == threads  # given back
    # the labels say the dtype this run used (fp32 on the CPU), not BF16
    assert "=== FP32 cache (DynamicCache) ===" in out and "=== OSCAR cache (INT2 pages, fp32 windows) ===" in out
    assert "fp32 cache: 6 tokens in" in out and "BF16 cache" not in out
    assert "token agreement: " in out
    # 406 tokens in 2 layers, every number from the layout
    assert "KV cache at 406 tokens, 2 layers, as deployed (BF16 windows): BF16 103,936 bytes, OSCAR" in out
    assert "sink 64 + INT2 5 pages x 16 + recent 262 tokens" in out  # D = 16: pages of G = 16 tokens


def test_generate_counts_each_layers_key_width(tiny_dir, capsys, tmp_path):
    """An artifact with 4-bit keys in one layer: the KV bytes count that layer's wider key pages."""
    from dataclasses import replace

    from transformers import AutoConfig

    from oscar_export.calibration.artifact import OscarArtifact

    art = OscarArtifact.identity(AutoConfig.from_pretrained(tiny_dir))
    replace(art, key_bits=(4, 2)).save(tmp_path / "art")
    prompt = " ".join(f"w{i % 90}" for i in range(400))
    assert main(["generate", "--model", tiny_dir, "--prompt", prompt, "--max-new-tokens", "6", "--device", "cpu",
                 "--skip-bf16", "--artifact", str(tmp_path / "art")]) == 0
    out = capsys.readouterr().out
    lay = art.layout
    want = lay.sequence_bytes(406) + lay.with_key_bits(4).sequence_bytes(406)
    assert f"OSCAR {want:,} bytes" in out and want > 2 * lay.sequence_bytes(406), out
    assert "=== OSCAR cache (INT2 / 4-bit-key pages, fp32 windows) ===" in out


def test_generate_says_when_the_prompt_never_reaches_the_int2_pages(tiny_dir, capsys):
    """A short prompt keeps every token in the full-precision windows: say so (before generating and
    in the summary) instead of reporting "saved 0 bytes"."""
    assert main(["generate", "--model", tiny_dir, "--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--device", "cpu",
                 "--skip-bf16"]) == 0
    out = capsys.readouterr().out
    assert "saved 0 bytes" not in out
    notes = [x for x in out.splitlines() if "never reach the INT2 pages" in x]
    assert len(notes) == 2, out  # the warning before generating, the summary after
    assert "7 tokens (3 prompt + 4 new)" in notes[0] and "at least 337 tokens" in notes[0]  # S0 64 + W 256 + P 16 + 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "w1", "--max-new-tokens", "0"], "--max-new-tokens: expected an int in [1, 1048576], got 0"),
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


# ---- sizes that cannot fit are refused before anything is allocated ------------------------------------------


@pytest.fixture
def no_cache(monkeypatch):
    """Building the OSCAR cache (or its hooks) means the size checks came too late."""
    import oscar_export.plugins.hf as hf

    def enable_oscar(*a, **k):
        raise AssertionError("enable_oscar was reached: the size was not checked first")

    monkeypatch.setattr(hf, "enable_oscar", enable_oscar)


def test_max_new_tokens_1e9_refused_before_model_load(monkeypatch, capsys, no_cache):
    import oscar_export.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["generate", "--prompt", "w1", "--max-new-tokens", "1000000000", "--skip-bf16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-new-tokens: expected an int in [1, 1048576], got 1000000000" in err, err


def test_longer_than_the_model_refused(tiny_dir, capsys, no_cache):
    argv = ["generate", "--model", tiny_dir, "--device", "cpu", "--prompt", "w1 w2", "--max-new-tokens", "3000",
            "--skip-bf16"]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "2 prompt + 3000 new tokens exceed the model's max_position_embeddings 2048" in last, last


def test_cache_larger_than_memory_refused(tiny_dir, capsys, monkeypatch, no_cache):
    import oscar_export.plugins.hf.cache_size as cache_size

    monkeypatch.setattr(cache_size, "available_bytes", lambda device: 1 << 19)  # 512 KiB free
    argv = ["generate", "--model", tiny_dir, "--device", "cpu", "--prompt", "w1 w2", "--max-new-tokens", "2000",
            "--skip-bf16"]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    # 2 layers x 2002 tokens x (K, V) x 2 KV heads x 16 x 4 bytes (fp32 on the CPU) = 1,025,024
    assert ("a KV cache of 2002 tokens needs 1,025,024 bytes at torch.float32 (2 layers, 2 KV heads x head_dim 16, "
            "K and V); 524,288 bytes available on cpu") in last, last


def test_a_chat_template_that_runs_for_minutes_is_stopped(monkeypatch):
    """A chat template with nested 1e5 x 1e5 loops is stopped (unbounded, it runs for minutes and takes gigabytes)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    import oscar_export.generate as gen

    class Tokenizer:  # renders its template as transformers does: jinja2's immutable sandbox
        chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"

        def apply_chat_template(self, messages, **kw):
            return ImmutableSandboxedEnvironment().from_string(self.chat_template).render(messages=messages)

    monkeypatch.setattr(gen, "CHAT_TEMPLATE_SECONDS", 1)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="--chat: the model's chat template ran past 1 s"):
        gen.render_chat(Tokenizer(), "hello")
    assert time.perf_counter() - t0 < 5
    Tokenizer.chat_template = "<user>{{ messages[0]['content'] }}</user>"
    assert gen.render_chat(Tokenizer(), "hello") == "<user>hello</user>"
