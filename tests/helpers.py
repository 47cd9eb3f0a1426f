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


def load_benchmark_script(name: str):
    """``benchmarks/<name>.py`` as a module (registered under ``name``: dataclasses look their module up)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod
