"""tests/plugins: the HF cache without a model (its tests and the attention tests), and the TensorRT-LLM adapter
against the stand-ins (its fixtures: tests/plugins/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout

# ---- tests/plugins: the HF cache without a model (its tests and the attention tests) -----------------------------

#: windows small enough that a few dozen tokens reach INT2 pages (the HF cache and attention tests).
SMALL_WINDOWS = dict(sink=4, window=16, page_size=16)


def small_layout(h_kv: int = 2, d: int = 32, granularity: str = "token") -> KVCacheLayout:
    """The default layout of ``h_kv`` KV heads of ``d`` with :data:`SMALL_WINDOWS`."""
    return KVCacheLayout.default(h_kv, d, granularity, **SMALL_WINDOWS)


def expected_contents(layout: KVCacheLayout, tr, k: torch.Tensor, v: torch.Tensor):
    """What a sequence that was written ``k, v [H_kv, L, D]`` (stored basis) must read back, built independently:
    sink and recent rows as written, history rows quantized page by page and dequantized."""
    from oscar_export.kernels import reference

    n = k.shape[1]
    s0, pages, _ = layout.split(n)
    p = layout.page_size
    hist = slice(s0, s0 + pages * p)

    def roundtrip(x, fmt, clip, levels):
        if pages == 0:
            return x[:, hist]
        xp = x[:, hist].reshape(x.shape[0], pages, p, x.shape[2]).transpose(0, 1)  # [N, H_kv, P, D]
        codes, params = reference.quantize_pages(xp, fmt, clip, levels)
        back = reference.dequantize_pages(codes, params, fmt, levels)
        return back.transpose(0, 1).reshape(x.shape[0], pages * p, x.shape[2])

    kk = torch.cat([k[:, :s0], roundtrip(k, layout.key, tr.k_clip, tr.k_levels), k[:, hist.stop :]], 1)
    vv = torch.cat([v[:, :s0], roundtrip(v, layout.value, tr.v_clip, tr.v_levels), v[:, hist.stop :]], 1)
    return kk, vv


def one_layer(layout: KVCacheLayout, tr, batch: int, max_length: int, layers: int = 1):
    """An ``OscarCache`` of ``layers`` layers sharing ``tr``; returns (cache, its first layer)."""
    from oscar_export.plugins.hf.cache import OscarCache

    cache = OscarCache(layout, [tr] * layers, batch, max_length)
    return cache, cache.layers[0]


def attention_oracle(q, k_ctx, v_ctx, tr, scale: float, causal_tail: int = 0) -> torch.Tensor:
    """Attention of ``q [H, Tq, D]`` (model basis) over ``k_ctx, v_ctx [H_kv, Tk, D]`` (stored basis) in fp64;
    the last ``causal_tail`` keys are the chunk itself (causal), returns ``[H, Tq, D]`` model basis."""
    h, tq, d = q.shape
    hkv = k_ctx.shape[0]
    g = h // hkv
    qs = tr.transform_queries(q[None])[0].double()
    s = torch.einsum("hqd,hkd->hqk", qs, k_ctx.double().repeat_interleave(g, 0)) * scale
    if causal_tail:
        tk = k_ctx.shape[1]
        pos_k = torch.arange(tk) - (tk - causal_tail)
        s = s.masked_fill(pos_k[None, None, :] > torch.arange(tq)[None, :, None], float("-inf"))
    o = torch.einsum("hqk,hkd->hqd", s.softmax(-1), v_ctx.double().repeat_interleave(g, 0))
    return tr.restore_output(o.float()[None])[0]


# ---- tests/plugins: the TensorRT-LLM adapter against the stand-ins (its fixtures: tests/plugins/conftest.py) --------

#: the adapter tests' layout (S0 16, W+P 32, P 16), model shape and ``max_seq_len``.
TRTLLM_LAYOUT = KVCacheLayout.default(2, 64, sink=16, window=16, page_size=16)
TRTLLM_HEADS, TRTLLM_LAYERS, TRTLLM_MAX_SEQ = 4, 2, 128
#: per-layer key widths: 4-bit key pages in layer 0, 2-bit in layer 1
MIXED_KEY_BITS = (4, 2)


def trtllm_model_config(**over):
    """The adapter tests' Llama ``config.json`` fields (``over`` replaces some)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_attention_heads": TRTLLM_HEADS,
            "num_key_value_heads": 2, "hidden_size": TRTLLM_HEADS * 64, "head_dim": 64,
            "num_hidden_layers": TRTLLM_LAYERS, "intermediate_size": 64, "vocab_size": 32, **over}


def trtllm_checkpoint(root, layout=TRTLLM_LAYOUT, key_bits=(), **over):
    """A TensorRT-LLM checkpoint folder (``config.json`` with its ``oscar`` section and an identity artifact) at
    ``root``; returns ``root``."""
    import json

    from transformers import LlamaConfig

    from oscar_export.calibration.artifact import OscarArtifact
    from oscar_export.plugins.trtllm.deployment import trtllm_config

    root.mkdir(parents=True)
    cfg = trtllm_model_config(**over)
    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    art = OscarArtifact.identity(hf, layout).with_values_prerotated()
    (art.with_key_bits(key_bits) if key_bits else art).save(root / "oscar")
    cfg = {**cfg, "oscar": {"format_version": 1, "artifact": "oscar", "layout": layout.to_dict()}}
    if cfg["model_type"] in ("llama",):
        cfg = trtllm_config(cfg)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def trtllm_bundle(root, layout=TRTLLM_LAYOUT, heads=TRTLLM_HEADS, scale=64 ** -0.5, archs=("sm_80", "sm_90"),
                  key_bits=None):
    """A fake kernel bundle (tests/plugins/fake_bundle.py) of the serving kernels of ``layout`` at ``root``."""
    from oscar_export.kernels.aot.bundle import serving_specs

    from fake_bundle import fake_bundle

    return fake_bundle(root, serving_specs(layout, heads, scale, probes=False, trt=False, key_bits=key_bits),
                       archs=archs)


def standins_only(ns):
    """The executor replays drive the stand-in C++ block manager and configs; the real one needs a GPU."""
    if getattr(ns, "real", False):
        pytest.skip("replays the stand-in C++ block manager (the real package: run it under trtllm-serve)")


def pretrained_config(dep):
    """The deployment's model config without its ``oscar`` section, as the executor's pretrained config."""
    from types import SimpleNamespace

    return SimpleNamespace(**{k: v for k, v in dep.config.items() if k != "oscar"})


def executor_driver(deploy, max_batch=3, **kw):
    """The executor-loop replay (tests/plugins/trtllm_driver.py) of a ``deploy`` fixture ``(ns, deployment)``."""
    from trtllm_driver import Driver

    ns, dep = deploy
    standins_only(ns)
    return Driver(ns, dep, max_batch, TRTLLM_MAX_SEQ, pretrained_config(dep), **kw)


def window_requests():
    """Prompts around the windows (S0 16, W+P 32, P 16) and enough steps for demotions in every request; request 5
    ends its prefill with a full recent window while others decode in the same step (it must not demote then)."""
    from trtllm_driver import Req

    return [Req(1, 5, 45), Req(2, 33, 35), Req(3, 49, 16), Req(4, 16, 40), Req(5, 48, 20)]
