"""``oscar_export/eval/recipes.py``: the research recipe, one ``U·H`` rotation per layer with global clip ratios."""

from __future__ import annotations

import pytest
import torch

from oscar_export.eval.recipes import research_recipe

from helpers import D, tiny_llama


def test_research_recipe_is_shared_u_h_with_global_clips():
    model = tiny_llama()
    m = research_recipe(model, torch.randint(0, 96, (2, 80)))
    t = m.transforms[0]
    assert m.param_dtype == "float32" and m.layout.key.granularity == "token"
    assert torch.equal(t.k_rotation[0], t.k_rotation[1]), "one rotation per layer, shared by the KV heads"
    eye = torch.eye(D)
    assert (t.k_rotation[0] @ t.k_rotation[0].T - eye).abs().max() < 1e-5
    assert t.k_clip.tolist() == pytest.approx([0.96, 0.96]) and t.v_clip.tolist() == pytest.approx([0.92, 0.92])
    assert m.bits_per_element(10_000) > m.layout.effective_bits_per_element(10_000)  # fp32 params cost more
