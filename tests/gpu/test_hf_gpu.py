"""The Hugging Face path on CUDA: ``backend="auto"`` picks the Triton kernels for a BF16 model and agrees with
the reference ops (random weights of a real-ish shape: mechanics, not accuracy). Run on the H200."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oscar_export.plugins.hf import cache_kwargs, enable_oscar

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def forced_logits(model, setup, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill ``prompt [1, T]`` then feed ``tokens [N]`` one by one; logits of every step ``[N + 1, V]`` fp32."""
    cache = setup.make_cache(1, prompt.shape[1] + tokens.numel() + 1)
    out = [model(prompt, use_cache=True, **cache_kwargs(model, cache)).logits[0, -1].float()]
    for t in tokens.tolist():
        ids = torch.tensor([[t]], device=prompt.device)
        out.append(model(ids, use_cache=True, **cache_kwargs(model, cache)).logits[0, -1].float())
    return torch.stack(out)


@torch.no_grad()
def test_auto_backend_is_triton_and_matches_reference_ops():
    pytest.importorskip("triton")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(0, 512, (1, 700), device="cuda")  # 700 > 64 + 256 + 64: INT2 pages from the prompt
    tokens = torch.randint(0, 512, (130,), device="cuda")  # crosses two demotions during decode

    with enable_oscar(model) as setup:
        assert setup.ops.name == "triton"
        got = forced_logits(model, setup, prompt, tokens)
    with enable_oscar(model, backend="torch") as setup:
        want = forced_logits(model, setup, prompt, tokens)
    assert torch.isfinite(got).all()
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"triton vs torch backend over {len(got)} steps: max relative logit error {rel:.2e}, top-1 agreement {top1:.3f}")
    assert rel < 2e-2, rel  # both run a BF16 model; the attention arithmetic differs (fp16 dot operands vs fp32)
    assert top1 >= 0.95, top1
