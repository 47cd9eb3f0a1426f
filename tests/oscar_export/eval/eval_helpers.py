"""Shared pieces of the evaluation tests: a tiny Llama, a random calibrated-looking transform, a character
tokenizer (ids are characters mod 96, decode maps ids to digits: enough for the NIAH mechanics)."""

from __future__ import annotations

import torch
import transformers

from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

D = 64
LAY = KVCacheLayout.default(2, D, sink=16, window=32, page_size=16)


def tiny_llama(layers: int = 2, max_positions: int = 4096):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=D,
                                   max_position_embeddings=max_positions)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def random_transform(h: int = 2, d: int = D, seed: int = 1) -> LayerTransform:
    g = torch.Generator().manual_seed(seed)
    rot = lambda: torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()  # noqa: E731
    lv = torch.tensor([0.0, 0.9, 2.1, 3.0]).expand(h, 4).contiguous()
    return LayerTransform(
        k_rotation=rot(), v_rotation=rot(), k_scale=0.5 + torch.rand(h, d, generator=g),
        v_scale=0.5 + torch.rand(h, d, generator=g), k_mean=0.1 * torch.randn(h, d, generator=g),
        v_mean=0.1 * torch.randn(h, d, generator=g), k_clip=torch.tensor([0.95, 1.0])[:h],
        v_clip=torch.tensor([0.9, 0.97])[:h], k_levels=lv, v_levels=lv.clone(),
    )


class CharTokenizer:
    """ids = characters mod 96; decode maps every id to one digit (so any answer is a number)."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [ord(c) % 96 for c in text]
        return type("E", (), {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids})()

    def decode(self, ids):
        return "".join(chr(48 + i % 10) for i in ids)
