"""``calibration/capture.py``: capture through AttentionInterface: post-RoPE tensors, untouched outputs, NaN errors,
and the attention scale and head counts read from the model-family table (the streamed sums: test_covariance.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from oscar_export.calibration.capture import Collector, run_batches

from helpers import CAPTURE_SHAPE, FAMILY_VOCAB, family_model

L, H, HKV, D = CAPTURE_SHAPE


def test_outputs_unchanged_and_implementation_restored(tiny):
    ids = torch.randint(0, 50, (2, 24))
    with torch.no_grad():
        ref = tiny(ids).logits
    col = Collector(L, HKV, D, skip=0, mode="heldout")
    run_batches(tiny, col, [ids])
    assert tiny.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(tiny(ids).logits, ref)
    q, k, v = col.heldout[0][0]
    assert q.shape == (2, H, 24, D) and k.shape == (2, HKV, 24, D) and v.shape == (2, HKV, 24, D)
    assert col.scaling[0] == pytest.approx(D**-0.5)


def test_keys_are_post_rope(tiny):
    """Layer 0 with one repeated token: pre-RoPE keys are identical, so captured keys must differ by
    position while keeping each rotary pair's norm, and q·k must depend only on the distance."""
    ids = torch.full((1, 12), 7)
    col = Collector(L, HKV, D, skip=0, mode="heldout")
    run_batches(tiny, col, [ids])
    q, k, _ = col.heldout[0][0]
    assert not torch.allclose(k[0, 0, 0], k[0, 0, 5])
    pair_norm = k[0, 0, :, : D // 2] ** 2 + k[0, 0, :, D // 2 :] ** 2  # rotate_half pairs (i, i + D/2)
    assert torch.allclose(pair_norm, pair_norm[:1].expand_as(pair_norm), rtol=1e-4, atol=1e-6)
    s = q[0, 0] @ k[0, 0].T  # query head 0 reads KV head 0
    assert torch.allclose(s[5, 2], s[8, 5], rtol=1e-4) and torch.allclose(s[9, 9], s[3, 3], rtol=1e-4)


def test_nan_activation_names_the_layer(tiny):
    bad = LlamaForCausalLM(tiny.config).eval()
    bad.load_state_dict(tiny.state_dict())
    with torch.no_grad():
        bad.model.layers[1].self_attn.k_proj.weight[3, 0] = float("nan")
    col = Collector(L, HKV, D, skip=0)
    with pytest.raises(ValueError, match="layer 1 produced .* non-finite \\(NaN/Inf\\) keys"):
        run_batches(bad, col, [torch.randint(0, 50, (1, 8))])
    assert bad.config._attn_implementation == "sdpa"  # restored even after the error


def test_bad_shapes_refused(tiny):
    col = Collector(L, 3, D, skip=0)  # wrong KV head count
    with pytest.raises(ValueError, match="expected keys \\[B, 3, T, 16\\], got \\(1, 2, 8, 16\\)"):
        run_batches(tiny, col, [torch.randint(0, 50, (1, 8))])
    st = Collector(L, HKV, D, skip=8)
    with pytest.raises(ValueError, match="skip=8 leaves no positions"):
        run_batches(tiny, st, [torch.randint(0, 50, (1, 8))])


@pytest.mark.parametrize("mode,where", [("stats", "late"), ("stats", "early"), ("heldout", "late")])
def test_nan_in_one_position_is_caught(tiny, mode, where):
    """A single non-finite value, inside or before the skipped sink positions, in either capture mode."""
    col = Collector(L, HKV, D, skip=4, mode=mode)

    class Fake:
        layer_idx = 1

    q, k, v = torch.randn(1, H, 8, D), torch.randn(1, HKV, 8, D), torch.randn(1, HKV, 8, D)
    v[0, 1, 2 if where == "early" else 6, 5] = float("inf")
    with pytest.raises(ValueError, match="layer 1 produced 1 non-finite \\(NaN/Inf\\) values"):
        col.observe(Fake(), q, k, v, None)


def test_capture_reads_scale_and_heads_from_the_table():
    model = family_model("gemma3")
    col = Collector.for_model(model, skip=0, mode="heldout")
    assert (col.num_layers, col.num_kv_heads, col.head_dim, col.model_scaling) == (2, 2, 256, 64**-0.5)
    run_batches(model, col, [torch.randint(0, FAMILY_VOCAB, (1, 8))])
    assert col.scaling == [64**-0.5] * 2
    q, k = torch.randn(1, 4, 3, 256), torch.randn(1, 2, 3, 256)
    col.observe(model.model.layers[0].self_attn, q, k, k, None)  # transformers passed no scale: the table's
    assert col.scaling[0] == 64**-0.5
    with pytest.raises(ValueError, match=r"capture layer 1: the model's attention scale 0.0625 is not the "
                                         r"family table's 0.125"):
        col.observe(model.model.layers[1].self_attn, q, k, k, 256**-0.5)
