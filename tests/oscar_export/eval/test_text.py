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
