"""The evaluation's fake-quantized attention: BF16 identities, the per-position rule against the real
reference cache fed token by token, the HF QuantizedCache replay against the real layer, noise and bypass."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from oscar_export.eval_attention import EvalContext, _one_row
from oscar_export.eval_methods import Method, hf_flushes, hf_quantized_count, kivi_values
from oscar_export.eval_metrics import compare_hidden, final_hidden
from oscar_export.eval_recipes import baseline_methods
from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform, hadamard

D = 64
LAY = KVCacheLayout.default(2, D, sink=16, window=32, page_size=16)


def tiny_llama(layers: int = 2):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=D,
                                   max_position_embeddings=512)
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


class FakeModule:
    def __init__(self, layer_idx: int = 0):
        self.layer_idx = layer_idx


def methods_for(model, lay=LAY):
    return {m.name: m for m in baseline_methods(model, lay)}


# ---- whole-model identities ----------------------------------------------------------------------------------


def test_quantization_disabled_reproduces_bf16_exactly():
    model = tiny_llama()
    ids = torch.randint(0, 96, (200,))
    ms = methods_for(model)
    ms["kivi2-small"] = Method("kivi2-small", "kivi", group=16, residual=32)
    base = final_hidden(model, ids, ms["bf16"])
    for name, m in ms.items():
        if name == "bf16" or name.startswith(("quarot", "hf-quanto")):  # rotations: see the next test
            continue
        got = final_hidden(model, ids, replace(m, quantize=False))
        assert torch.equal(got, base), f"{name}: max diff {(got - base).abs().max():.3e}"
        assert not torch.equal(final_hidden(model, ids, m), base), f"{name}: quantized path changed nothing"


def test_orthogonal_rotation_without_quantization_matches_bf16_to_fp32_rounding():
    """Rotation, scaling and means are undone exactly in math; in fp32 the error is rounding (< 1e-4 here)."""
    model = tiny_llama()
    ids = torch.randint(0, 96, (150,))
    base = final_hidden(model, ids, Method("bf16", "full"), torch.float32)
    h = hadamard(D).float().expand(2, D, D)
    for name, t in (("hadamard", replace(LayerTransform.identity(2, D), k_rotation=h, v_rotation=h)),
                    ("random", random_transform())):
        m = Method(name, "pages", layout=LAY, transforms=[t, t], quantize=False)
        got = final_hidden(model, ids, m, torch.float32)
        err = (got - base).abs().max().item()
        assert err < 1e-4 * base.abs().max().item(), f"{name}: max abs error {err:.3e}"
        q = final_hidden(model, ids, replace(m, quantize=True), torch.float32)
        assert (q - base).abs().max().item() > 100 * err, f"{name}: quantization had no effect"


def test_short_sequences_inside_the_windows_match_bf16():
    model = tiny_llama()
    ids = torch.randint(0, 96, (LAY.sink + LAY.recent_capacity,))  # no page yet at any position
    ms = methods_for(model)
    base = final_hidden(model, ids, ms["bf16"])
    for name in ("int2-naive", "quarot-int2"):
        got = final_hidden(model, ids, ms[name])
        tol = 0 if name == "int2-naive" else 2e-2
        assert (got - base).abs().max().item() <= tol, name
    longer = torch.randint(0, 96, (LAY.sink + LAY.recent_capacity + 1,))
    b2 = final_hidden(model, longer, ms["bf16"])
    g2 = final_hidden(model, longer, ms["int2-naive"])
    assert torch.equal(g2[:-1], b2[:-1]) and not torch.equal(g2[-1], b2[-1]), "first page must change the last row"


def test_noise_in_place_of_dequantized_values_scores_far_worse():
    model = tiny_llama()
    ids = torch.randint(0, 96, (256,))
    t = random_transform()
    m = Method("x", "pages", layout=LAY, transforms=[t, t])
    base = final_hidden(model, ids, Method("bf16", "full"))
    kl_q = compare_hidden(model, base, final_hidden(model, ids, m), ids, 0).summary()["kl"]
    kl_n = compare_hidden(model, base, final_hidden(model, ids, replace(m, noise=True)), ids, 0).summary()["kl"]
    assert kl_q > 0 and kl_n > 5 * kl_q, f"KL quantized {kl_q:.3e}, noise {kl_n:.3e}"


# ---- the per-position rule against the real reference cache fed token by token -------------------------------


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_fake_quant_rows_match_reference_cache_token_by_token(granularity):
    """Row ``a`` of the one-pass fake quantization == decode_attention over the reference cache after a+1 appends."""
    lay = KVCacheLayout.default(2, D, granularity, sink=16, window=32, page_size=16)
    t = random_transform()
    m = Method("x", "pages", layout=lay, transforms=[t])
    T = lay.sink + lay.recent_capacity + 3 * lay.page_size + 5
    q = torch.randn(4, T, D)
    k = torch.randn(2, T, D)
    v = torch.randn(2, T, D)
    ctx = EvalContext([m], "score", torch.bfloat16)
    got = _one_row(ctx, m, 0, 0, q, k, v, D ** -0.5)  # [H, T, D]
    state = PagedKV.allocate(lay, 1, pool_pages=16, max_pages=16)
    pages = iter(range(16))
    ks = t.transform_keys(k.unsqueeze(0))[0]
    vs = t.transform_values(v.unsqueeze(0))[0]
    qs = t.transform_queries(q.unsqueeze(0))  # [1, H, T, D]
    worst = 0.0
    for a in range(T):
        ref.append_tokens(state, 0, ks[:, a : a + 1], vs[:, a : a + 1], lay, t, lambda: next(pages))
        o = ref.decode_attention(qs[:, :, a], state, lay, t.k_levels, t.v_levels, D ** -0.5)  # [1, H, D]
        o = t.restore_output(o.unsqueeze(2))[0, :, 0]
        worst = max(worst, (o - got[:, a]).abs().max().item())
    assert int(state.num_pages[0]) == lay.pages_for(T) == 4
    assert worst < 2e-5, f"worst |fake - reference cache| = {worst:.3e}"


def test_kivi_rule_and_bits():
    m = Method("k", "kivi", group=32, residual=128)
    lo, k_hi, v_hi = m.int2_ranges(torch.tensor([0, 126, 127, 255, 300]))
    assert k_hi.tolist() == [0, 0, 128, 256, 256] and v_hi.tolist() == [0, 0, 0, 128, 173] and lo.tolist() == [0] * 5
    assert m.bits_per_element(128) == pytest.approx((128 * 16 + 128 * 3 + 0) / 256)
    x = torch.randn(2, 5, 64)
    assert (kivi_values(x, 32) - x).abs().max() > 0
    with pytest.raises(ValueError, match="multiple of group"):
        Method("k", "kivi", group=32, residual=100)


def test_page_method_bits_follow_the_layout():
    model = tiny_llama(1)
    ms = methods_for(model)
    for L in (100, 1000):
        assert ms["int2-naive"].bits_per_element(L) == LAY.effective_bits_per_element(L)
    fp32 = replace(ms["int2-naive"], param_dtype="float32")
    assert fp32.bits_per_element(1000) > ms["int2-naive"].bits_per_element(1000)
    assert ms["bf16"].bits_per_element(10) == 16.0


# ---- the HF QuantizedCache replay against the real layer fed token by token ---------------------------------------


def test_hf_flush_schedule():
    # transformers flushes when residual + new >= R: tokens 1..3 wait, token 4 triggers (0..4 quantized)
    assert hf_flushes(1, 10, 4) == [(1, 1), (5, 5), (9, 9)]
    assert hf_quantized_count(1, 10, 4) == 9
    assert hf_flushes(5, 6, 4) == [(5, 5)]


@pytest.mark.parametrize("backend", ["hqq", pytest.param("quanto", marks=pytest.mark.slow)])
def test_hf_replay_matches_real_quantized_layer(backend):
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = HQQQuantizedLayer if backend == "hqq" else QuantoQuantizedLayer
    m = Method("hf", "hf", backend=backend, residual=8)
    T = 40
    q = torch.randn(4, T, D)
    k = torch.randn(2, T, D)
    v = torch.randn(2, T, D)
    got = _one_row(EvalContext([m], "score", torch.float32), m, 0, 0, q, k, v, D ** -0.5)
    real = cls(nbits=2, q_group_size=64, residual_length=8)
    worst = 0.0
    for a in range(T):
        kk, vv = real.update(k[None, :, a : a + 1], v[None, :, a : a + 1])
        o = ref.masked_attention(q[None, :, a : a + 1], kk, vv, torch.ones(1, 1, a + 1, dtype=torch.bool), D ** -0.5)
        worst = max(worst, (o[0, :, 0] - got[:, a]).abs().max().item())
    assert worst < 2e-5, f"worst |replay - real QuantizedLayer| = {worst:.3e}"


def test_decode_mode_matches_score_mode():
    """The NIAH decode path (shared prefix, memoised quantization) gives the one-pass rows."""
    lay = LAY
    t = random_transform()
    ms = [Method("p", "pages", layout=lay, transforms=[t]), Method("k", "kivi", group=16, residual=32),
          Method("h", "hf", backend="hqq", residual=16)]
    T, n0 = 150, 140
    q = torch.randn(4, T, D)
    k = torch.randn(2, T, D)
    v = torch.randn(2, T, D)
    for m in ms:
        ctx = EvalContext([m], "decode", torch.bfloat16, prefill_len=n0)
        ctx.prefix_k, ctx.prefix_v = {0: k[None, :, :n0]}, {0: v[None, :, :n0]}
        one = EvalContext([m], "score", torch.bfloat16, prefill_len=n0)
        full = _one_row(one, m, 0, 0, q, k, v, D ** -0.5)
        for a in range(n0, T):
            o = _one_row(ctx, m, 0, 0, q[:, a : a + 1], k[:, : a + 1], v[:, : a + 1], D ** -0.5)
            err = (o[:, 0] - full[:, a]).abs().max().item()
            assert err < 1e-5, f"{m.name} position {a}: {err:.3e}"


# ---- bad input -------------------------------------------------------------------------------------------------


def test_bad_methods_rejected():
    with pytest.raises(ValueError, match="kind"):
        Method("x", "nope")
    with pytest.raises(ValueError, match="needs a layout"):
        Method("x", "pages")
    with pytest.raises(ValueError, match="backend"):
        Method("x", "hf", backend="gptq")
    with pytest.raises(ValueError, match="transform 0"):
        Method("x", "pages", layout=LAY, transforms=[LayerTransform.identity(3, D)])
    with pytest.raises(ValueError, match="mode"):
        EvalContext([], "train")
