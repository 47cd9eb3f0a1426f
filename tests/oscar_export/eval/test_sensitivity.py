"""``oscar_export.eval.sensitivity``: the per-layer attention error of stored keys on calibration text, and the
4-bit key allocation it drives (toy model from ``benchmarks/niah_diagnose.py``, CPU)."""

from __future__ import annotations

import pytest
import torch

from oscar_export.eval import sensitivity as S
from oscar_export.eval.levers import variant
from test_niah_diagnose import _script


@pytest.fixture(scope="module")
def toy():
    model, tok, ours, _ = _script().tiny_random_setup()
    ids = S.calibration_windows(tok, 256, 2)
    return model, ours, S.capture(model, ids)


def test_error_is_zero_for_bf16_pages_and_shrinks_with_wider_codes(toy):
    model, ours, col = toy
    k16 = variant(ours, "K16", units=((0, -1, "k", 16), (1, -1, "k", 16)))
    for layer in (0, 1):
        e2 = S.key_attention_error(col, layer, ours, queries=32)
        e4 = S.key_attention_error(col, layer, variant(ours, "K4", units=((layer, -1, "k", 4),)), queries=32)
        e16 = S.key_attention_error(col, layer, k16, queries=32)
        assert e16 == {"kl": 0.0, "top": 0.0}
        assert e2["kl"] > e4["kl"] > 0 and e2["top"] > e4["top"] > 0, (layer, e2, e4)


def test_error_refuses_windows_without_pages(toy):
    model, ours, _ = toy
    short = S.capture(model, torch.arange(64).view(1, 64) % 96)
    with pytest.raises(ValueError, match="leave no page"):
        S.key_attention_error(short, 0, ours, queries=16)


def test_allocate_takes_the_largest_gain_first_within_the_budget(toy):
    _, ours, _ = toy
    errors = {2: [{"kl": 0.1, "top": 0.5}, {"kl": 0.9, "top": 0.1}], 4: [{"kl": 0.0, "top": 0.0}] * 2}
    one = variant(ours, "p", units=((1, -1, "k", 4),)).page_bits()
    m, layers = S.allocate(ours, errors, one, metric="kl")
    assert layers == [1] and m.page_bits() == pytest.approx(one) and m.units == ((1, -1, "k", 4),)
    assert S.allocate(ours, errors, one, metric="top")[1] == [0]
    assert S.allocate(ours, errors, one - 1e-3)[1] == []
    assert S.allocate(ours, errors, 16.0)[1] == [0, 1]
