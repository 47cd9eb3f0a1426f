"""``oscar_export/eval/cache_models.py``: the cache models behind the fake-quantized attention: BF16 identities, the
per-position rule against the real reference cache fed token by token, bits, bad input (the HF QuantizedCache
replay against the real layer: test_hf_quantized.py; decode reuse across demotions and flushes: test_attention.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from oscar_export.eval.attention import EvalContext, sequence_attention
from oscar_export.eval.cache_models import BF16Cache, CacheModel, Kivi2, PagedInt2
from oscar_export.eval.hf_quantized import HFQuantized, hf_quantized_count
from oscar_export.eval.recipes import baseline_methods
from oscar_export.eval.text import compare_hidden, final_hidden
from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.transform import LayerTransform, hadamard

from helpers import EVAL_LAYOUT, D, eval_transform, tiny_llama


def methods_for(model, lay=EVAL_LAYOUT):
    return {m.name: m for m in baseline_methods(model, lay)}


def all_positions(ids):
    return torch.ones(ids.numel() - 1, dtype=torch.bool)


# ---- whole-model identities ----------------------------------------------------------------------------------


def test_quantization_disabled_reproduces_bf16_exactly():
    model = tiny_llama()
    ids = torch.randint(0, 96, (200,))
    ms = methods_for(model)
    ms["kivi2-small"] = Kivi2("kivi2-small", group=16, residual=32)
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
    base = final_hidden(model, ids, BF16Cache("bf16"), torch.float32)
    h = hadamard(D).float().expand(2, D, D)
    for name, t in (("hadamard", replace(LayerTransform.identity(2, D), k_rotation=h, v_rotation=h)),
                    ("random", eval_transform())):
        m = PagedInt2(name, layout=EVAL_LAYOUT, transforms=(t, t), quantize=False)
        got = final_hidden(model, ids, m, torch.float32)
        err = (got - base).abs().max().item()
        assert err < 1e-4 * base.abs().max().item(), f"{name}: max abs error {err:.3e}"
        q = final_hidden(model, ids, replace(m, quantize=True), torch.float32)
        assert (q - base).abs().max().item() > 100 * err, f"{name}: quantization had no effect"


def test_short_sequences_inside_the_windows_match_bf16():
    model = tiny_llama()
    ids = torch.randint(0, 96, (EVAL_LAYOUT.sink + EVAL_LAYOUT.recent_capacity,))  # no page yet at any position
    ms = methods_for(model)
    base = final_hidden(model, ids, ms["bf16"])
    for name in ("int2-naive", "quarot-int2"):
        got = final_hidden(model, ids, ms[name])
        tol = 0 if name == "int2-naive" else 2e-2
        assert (got - base).abs().max().item() <= tol, name
        assert not ms[name].reads_quantized(torch.arange(ids.numel())).any()
    longer = torch.randint(0, 96, (EVAL_LAYOUT.sink + EVAL_LAYOUT.recent_capacity + 1,))
    b2 = final_hidden(model, longer, ms["bf16"])
    g2 = final_hidden(model, longer, ms["int2-naive"])
    assert torch.equal(g2[:-1], b2[:-1]) and not torch.equal(g2[-1], b2[-1]), "first page must change the last row"
    reads = ms["int2-naive"].reads_quantized(torch.arange(longer.numel())).tolist()
    assert reads == [False] * (longer.numel() - 1) + [True]


def test_noise_in_place_of_dequantized_values_scores_far_worse():
    model = tiny_llama()
    ids = torch.randint(0, 96, (256,))
    t = eval_transform()
    m = PagedInt2("x", layout=EVAL_LAYOUT, transforms=(t, t))
    base = final_hidden(model, ids, BF16Cache("bf16"))
    q = all_positions(ids)
    kl_q = compare_hidden(model, base, final_hidden(model, ids, m), ids, q).summary()["kl"]
    kl_n = compare_hidden(model, base, final_hidden(model, ids, replace(m, noise=True)), ids, q).summary()["kl"]
    assert kl_q > 0 and kl_n > 5 * kl_q, f"KL quantized {kl_q:.3e}, noise {kl_n:.3e}"


# ---- the per-position rule against the real reference cache fed token by token -------------------------------


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_fake_quant_rows_match_reference_cache_token_by_token(granularity):
    """Row ``a`` of the one-pass fake quantization == decode_attention over the reference cache after a+1 appends."""
    lay = KVCacheLayout.default(2, D, granularity, sink=16, window=32, page_size=16)
    t = eval_transform()
    m = PagedInt2("x", layout=lay, transforms=(t,))
    T = lay.sink + lay.recent_capacity + 3 * lay.page_size + 5
    q = torch.randn(4, T, D)
    k = torch.randn(2, T, D)
    v = torch.randn(2, T, D)
    ctx = EvalContext([m], "score", torch.bfloat16)
    got = sequence_attention(ctx, m, 0, 0, q, k, v, D ** -0.5)  # [H, T, D]
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
    m = Kivi2("k", group=32, residual=128)
    lo, k_hi, v_hi = m.int2_ranges(torch.tensor([0, 126, 127, 255, 300]))
    assert k_hi.tolist() == [0, 0, 128, 256, 256] and v_hi.tolist() == [0, 0, 0, 128, 173] and lo.tolist() == [0] * 5
    assert m.bits_per_element(128) == pytest.approx((128 * 16 + 128 * 3 + 0) / 256)
    assert m.reads_quantized(torch.tensor([0, 126, 127])).tolist() == [False, False, True]


def test_page_method_bits_follow_the_layout():
    model = tiny_llama(1)
    ms = methods_for(model)
    for L in (100, 1000):
        assert ms["int2-naive"].bits_per_element(L) == EVAL_LAYOUT.effective_bits_per_element(L)
    fp32 = replace(ms["int2-naive"], param_dtype="float32")
    assert fp32.bits_per_element(1000) > ms["int2-naive"].bits_per_element(1000)
    assert ms["bf16"].bits_per_element(10) == 16.0
    # HF: 2-bit codes + 2 x 16-bit params per 64 = 2.5 bits, 4-bit: 4.5, the residual at 16
    q = hf_quantized_count(1, 1000, 128)
    assert ms["hf-quanto-int2"].bits_per_element(1000) == pytest.approx((q * 2.5 + (1000 - q) * 16) / 1000)
    assert ms["hf-hqq-int4"].bits_per_element(1000) == pytest.approx((q * 4.5 + (1000 - q) * 16) / 1000)


# ---- bad input -------------------------------------------------------------------------------------------------


def test_bad_methods_rejected():
    with pytest.raises(TypeError):
        CacheModel("x")  # the protocol itself is abstract
    with pytest.raises(ValueError, match="needs a layout"):
        PagedInt2("x")
    with pytest.raises(ValueError, match="backend"):
        HFQuantized("x", backend="gptq")
    with pytest.raises(ValueError, match="nbits"):
        HFQuantized("x", nbits=3)
    with pytest.raises(ValueError, match="transform 0"):
        PagedInt2("x", layout=EVAL_LAYOUT, transforms=(LayerTransform.identity(3, D),))
    with pytest.raises(ValueError, match="multiple of group"):
        Kivi2("k", group=32, residual=100)
    with pytest.raises(ValueError, match="param_dtype"):
        PagedInt2("x", layout=EVAL_LAYOUT, transforms=(LayerTransform.identity(2, D),), param_dtype="float8")
    with pytest.raises(ValueError, match="mode"):
        EvalContext([], "train")
