"""Tiny random-weight models, transforms, artifacts, a character tokenizer and a tiny exported checkpoint, shared by
every test folder; the boundary-heavy shape grid."""

from __future__ import annotations

import torch

from oscar_export.kernels.layout import KVCacheLayout

#: the boundary-heavy shape grid (docs/design.md §8): lengths around the windows for
#: the default S0=64, W=256, P=64: 1, S0-1, S0, S0+1, S0+W, S0+W+1, S0+W+P (last length without pages), +1 (first
#: page), page edges and odd lengths.
BOUNDARY_LENGTHS = [1, 63, 64, 65, 320, 321, 384, 385, 448, 449, 511, 777]
#: (query heads, KV heads): GQA ratios 1, 3, 4, 8.
GQA_SHAPES = [(3, 3), (9, 3), (8, 2), (16, 2)]
HEAD_DIMS = [64, 128]

#: the tiny HF-path model (:func:`tiny_hf_model`): 4 query / 2 KV heads of 16, 2 layers.
HF_MODEL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
)
#: its layout with windows small enough that a few dozen tokens reach INT2 pages.
SMALL_LAYOUT = KVCacheLayout.default(2, 16, "channel", sink=4, window=16, page_size=16)
#: :func:`tiny_llama`'s head_dim, and the evaluation tests' layout of its 2 KV heads (sink 16, window 32, P 16).
D = 64
EVAL_LAYOUT = KVCacheLayout.default(2, D, sink=16, window=32, page_size=16)


def randomize_biases_and_norms(model):
    """Random q/k/v biases and q/k norms (zero / one at init) so the tests exercise those code paths."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
            if "q_norm" in name or "k_norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def tiny_hf_model(kind: str = "llama"):
    """A random-weight Llama / Qwen2 / Qwen3 of :data:`HF_MODEL`'s shape (fp32, eval), biases and norms random."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cls, cfg = {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config),
    }[kind]
    return randomize_biases_and_norms(cls(cfg(**HF_MODEL)).eval())


def tiny_llama(layers: int = 2, dtype: torch.dtype = torch.float32, max_positions: int = 4096):
    """A random-weight Llama with the attention shape of a real one at toy size: 4 query / 2 KV heads of :data:`D`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=D, max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_model(kind: str = "llama", heads: int = 6, kv_heads: int = 2, head_dim: int = 16, layers: int = 2):
    """A random-weight Llama or Qwen2 (``v_proj`` with a bias) for the export tests: hidden 48, vocab 97, fp32."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=128,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        raise ValueError(kind)
    return model.float().eval()


def rotated_transform(h_kv: int, d: int, seed: int = 0, prerotated: bool = False, k_clip=0.95, v_clip=0.9,
                      levels=(0.0, 1.0, 2.0, 3.0)):
    """Per-head random orthogonal K/V rotations, scalings, means and clipping: every term of the basis change.
    ``k_clip`` / ``v_clip``: one ratio or one per head; ``levels``: the 4 code levels of both sides."""
    from oscar_export.kernels.transform import LayerTransform

    g = torch.Generator().manual_seed(seed)
    rot = lambda: torch.linalg.qr(torch.randn(h_kv, d, d, generator=g))[0].contiguous()  # noqa: E731
    pos = lambda: (0.5 + torch.rand(h_kv, d, generator=g))  # noqa: E731
    clip = lambda c: torch.tensor(c, dtype=torch.float32).expand(h_kv).contiguous()  # noqa: E731
    lv = torch.tensor(levels, dtype=torch.float32).expand(h_kv, 4).contiguous()
    return LayerTransform(
        k_rotation=rot(), v_rotation=rot(), k_scale=pos(), v_scale=pos(),
        k_mean=0.1 * torch.randn(h_kv, d, generator=g), v_mean=0.1 * torch.randn(h_kv, d, generator=g),
        k_clip=clip(k_clip), v_clip=clip(v_clip), k_levels=lv, v_levels=lv.clone(), values_prerotated=prerotated,
    )


def eval_transform(seed: int = 1):
    """:func:`rotated_transform` of :data:`EVAL_LAYOUT`'s heads with what the evaluation's quantizers must honour: a
    clip ratio per head (head 1's keys unclipped) and non-uniform levels."""
    return rotated_transform(2, D, seed, k_clip=(0.95, 1.0), v_clip=(0.9, 0.97), levels=(0.0, 0.9, 2.1, 3.0))


class CharTokenizer:
    """ids = characters mod 96; decode maps every id to one digit (so any answer is a number)."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [ord(c) % 96 for c in text]
        return type("E", (), {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids})()

    def decode(self, ids):
        return "".join(chr(48 + i % 10) for i in ids)


def random_artifact(model):
    """An artifact for ``model`` with :func:`rotated_transform` layers and small windows (sink 4, window 16, P 16)."""
    from oscar_export.calibration.artifact import OscarArtifact, model_fingerprint

    c = model.config
    layout = KVCacheLayout.default(c.num_key_value_heads, c.head_dim, sink=4, window=16, page_size=16)
    ts = tuple(rotated_transform(c.num_key_value_heads, c.head_dim, seed=i) for i in range(c.num_hidden_layers))
    return OscarArtifact(layout, ts, model_fingerprint(c), {"method": "random-test"}, {})


def logits(model, ids):
    """``model(ids).logits`` in float64, no autograd."""
    with torch.no_grad():
        return model(ids).logits.double()


def tiny_export(path, kv_heads: int = 1, packing: str = "linear"):
    """A one-layer random Llama (head_dim 64) exported with identity transforms to ``path``; returns the path."""
    import transformers

    from oscar_export.calibration.artifact import OscarArtifact, model_fingerprint
    from oscar_export.export import export_checkpoint
    from oscar_export.kernels.transform import LayerTransform

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    layout = KVCacheLayout.default(kv_heads, 64, packing=packing)
    art = OscarArtifact(layout, (LayerTransform.identity(kv_heads, 64),), model_fingerprint(cfg), {}, {})
    return export_checkpoint(model, None, art, path)
