"""The real thing on SmolLM2-135M-Instruct: `oscar-export calibrate` + `inspect`, then the artifact drives
the HF OSCAR cache (enable_oscar) on a prompt long enough to have INT2 pages, from text calibration never saw.

Slow (model load, capture of 30 layers, fit, a generation on the reference ops): one test, because each step
needs the previous one's artifact."""

from __future__ import annotations

import pytest
import torch

from oscar_export.calibration.artifact import load_artifact
from oscar_export.calibration.data import pydoc_text
from oscar_export.cli import main

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")]


def test_calibrate_inspect_and_generate(smollm2, tmp_path, capsys):
    model, tok = smollm2
    out = tmp_path / "art"
    rc = main(["calibrate", "--model", "default", "--out", str(out), "--tokens", "2560", "--heldout", "1", "--quiet",
               "--key-bits-budget", "none"])  # the 2-bit format on 512-token sequences: a minute
    assert rc == 0
    summary = capsys.readouterr().out
    assert "wrote" in summary and "bits/element" in summary
    art = load_artifact(out, model.config)
    assert art.num_layers == 30 and art.layout.num_kv_heads == 3 and art.layout.head_dim == 64
    layers = art.stats["layers"]
    k_id = sum(x["k"]["vs_identity"] for x in layers) / 30
    v_id = sum(x["v"]["vs_identity"] for x in layers) / 30
    k_had = sum(x["k"]["vs_hadamard"] for x in layers) / 30
    print(f"held-out error vs identity K {k_id:.3f} V {v_id:.3f}; keys vs Hadamard+global clip {k_had:.3f}")
    assert k_id < 0.85 and v_id < 0.85 and k_had < 1.0

    assert main(["inspect", str(out), "--layers"]) == 0
    shown = capsys.readouterr().out
    assert "30 layers" in shown and "bits/elem" in shown and "max |R^T R - I|" in shown

    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    ids = tok(pydoc_text("evaluation")[:3000], return_tensors="pt").input_ids[:, :600]  # 600 tokens: 3 INT2 pages
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[:, 600:]
    with enable_oscar(model, str(out)) as oscar:
        cache = oscar.make_cache(1, 640)
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
        got = got[:, 600:]
    assert int(cache.layers[0].state.num_pages[0]) > 0, "the prompt must reach the INT2 pages"
    agree = int((got == want).cumprod(-1).sum())
    print(f"greedy tokens identical to the full-precision cache before the first divergence: {agree}/24")
    print("oscar:", tok.decode(got[0]))
    assert got.shape == (1, 24) and agree >= 4
