"""The decode step's kernels compiled ahead in worker processes (``plugins/hf/precompile.py``), on a CUDA GPU.

    python -m pytest tests/gpu/test_precompile_gpu.py -m gpu -q

A child process with an empty Triton cache folder: ``make_cache`` starts one worker per layer format (4- and 2-bit
keys, rotated keys, values pre-rotated: a calibrated artifact's shape), every worker exits 0, and then a decode step
of the main process compiles none of the cache's kernels (no new binary in the cache folder other than Inductor's
own ``triton_*`` kernels): it found every kernel the workers compiled. Both ways a step runs: eager, and the README
loop's ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (the graph's tensors can be
specialised differently from an eager call's: alignment, strides).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import os
    import sys
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar_export.kernels.layout import KVCacheLayout
    from oscar_export.kernels.transform import LayerTransform
    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    def binaries():
        return {os.path.join(d, f) for d, _, fs in os.walk(os.environ["TRITON_CACHE_DIR"]) for f in fs
                if f.endswith((".cubin", ".json")) and not f.startswith(("triton_", "__grp__triton_"))}

    compiled_step = sys.argv[1] == "compiled"

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    ts = []
    for _ in range(2):
        t = LayerTransform.identity(4, 128, 0.96, 0.92)
        ts.append(LayerTransform(
            k_rotation=torch.linalg.qr(torch.randn(4, 128, 128, generator=g))[0].contiguous(),
            v_rotation=t.v_rotation, k_scale=2 ** (2 * torch.rand(4, 128, generator=g) - 1), v_scale=t.v_scale,
            k_mean=0.1 * torch.randn(4, 128, generator=g), v_mean=0.01 * torch.randn(4, 128, generator=g),
            k_clip=t.k_clip, v_clip=t.v_clip, k_levels=t.k_levels, v_levels=t.v_levels, values_prerotated=True))
    art = SimpleNamespace(layout=KVCacheLayout.default(4, 128, "channel"), transforms=tuple(ts), key_bits=(4, 2),
                          check_model=lambda config: None)
    with torch.no_grad(), enable_oscar(model, art) as oscar:
        cache = oscar.make_cache(2, 1000)
        assert cache.precompile is not None and len(cache.precompile.procs) == 2, cache.precompile
        failed = cache.precompile.wait()
        assert not failed, failed
        cache.precompile = None
        compiled = binaries()
        assert len(compiled) >= 4, compiled
        model(torch.randint(1, 256, (2, 5), device="cuda"), **cache_kwargs(model, cache))  # in the sink: no page
        step = (torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled_step
                else model.forward)
        step(torch.randint(1, 256, (2, 1), device="cuda"), position_ids=torch.full((2, 1), 5, device="cuda"),
             **cache_kwargs(model, cache))
        torch.cuda.synchronize()
        new = binaries() - compiled
        assert not new, f"the {sys.argv[1]} step compiled {sorted(new)}"
    print("precompiled:", len(compiled), f"files; the {sys.argv[1]} step compiled none")
""")


@pytest.mark.parametrize("step", ["eager", "compiled"])
def test_the_first_step_finds_the_kernels_the_workers_compiled(step):
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as inductor:
        env = dict(os.environ, TRITON_CACHE_DIR=folder, TORCHINDUCTOR_CACHE_DIR=inductor)
        proc = subprocess.run([sys.executable, "-c", SCRIPT, step], env=env, capture_output=True, text=True,
                              timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"the {step} step compiled none" in proc.stdout
