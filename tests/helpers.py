"""Test helpers shared by several test files (docs/design.md §2: one home)."""

from __future__ import annotations


def randomize_biases_and_norms(model):
    """Random q/k/v biases and q/k norms (zero / one at init) so the tests exercise those code paths."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
            if "q_norm" in name or "k_norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model

