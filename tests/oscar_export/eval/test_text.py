"""oscar_export/eval/text.py: the text scores."""

from __future__ import annotations

import torch

from oscar_export.eval.text import LOGIT_CHUNK, score_methods, score_prefixes


def test_methods_scored_together_equal_each_scored_alone():
    """score_methods (the reference's log-probabilities once per chunk for every method) gives each method exactly
    the numbers of its own score_prefixes call, at every prefix length."""
    g = torch.Generator().manual_seed(0)
    t, vocab = LOGIT_CHUNK + 37, 50  # two chunks, the second partial
    ids = torch.randint(vocab, (t + 1,), generator=g)
    ref = torch.randn(t, vocab, generator=g)
    gots = {name: ref + s * torch.randn(t, vocab, generator=g) for name, s in (("a", 0.0), ("b", 0.3), ("c", 2.0))}
    quantized = {name: torch.rand(t, generator=g) < p for name, p in (("a", 0.0), ("b", 0.5), ("c", 0.9))}
    lengths = [2, 100, t + 1]
    together = score_methods(lambda c0, c1: ref[c0:c1],
                             {n: (lambda c0, c1, x=x: x[c0:c1], quantized[n]) for n, x in gots.items()}, ids, lengths)
    for name, x in gots.items():
        alone = score_prefixes(lambda c0, c1: ref[c0:c1], lambda c0, c1, x=x: x[c0:c1], ids, quantized[name], lengths)
        for L in lengths:
            assert together[name][L] == alone[L], (name, L)
    assert together["a"][t + 1].kl == 0.0 < together["b"][t + 1].kl < together["c"][t + 1].kl


def test_dev_windows_end_at_the_text_end_and_never_overlap_the_report_ones():
    import pytest

    from oscar_export.eval.text import text_windows

    class Tok:  # one token per character: the token ids are the character positions
        def __call__(self, text, return_tensors=None, add_special_tokens=False):
            return type("E", (), {"input_ids": torch.arange(len(text)).view(1, -1)})()

    text = "x" * 1000
    report = text_windows(Tok(), 100, 3, text=text)
    dev = text_windows(Tok(), 100, 3, text=text, split="dev")
    assert torch.equal(report.flatten(), torch.arange(300)) and torch.equal(dev.flatten(), torch.arange(700, 1000))
    assert torch.equal(text_windows(Tok(), 100, 5, text=text, split="dev").flatten(), torch.arange(500, 1000))
    with pytest.raises(ValueError, match="3 dev windows of 200 tokens past the report ones need 1200 tokens, the "
                                         r"text has 1000 \(use fewer windows: at most 2 of 200 tokens\)"):
        text_windows(Tok(), 200, 3, text=text, split="dev")
    with pytest.raises(ValueError, match=r"split expected one of \('report', 'dev'\), got 'test'"):
        text_windows(Tok(), 100, 1, text=text, split="test")
