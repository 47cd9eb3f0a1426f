"""The README's serving loop under ``torch.compile(fullgraph=True)`` on the CPU, and a model without Triton (issue 26).

``step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` must trace every backend's decode
step in one graph: nothing in it may read a pointer, a device value or a shape-dependent Python value (every check
runs when the cache is made). On the CPU: the reference backend end to end, and the hopper backend's step traced
by Dynamo (its kernels need an sm_90 GPU: tests/gpu/test_hf_gpu.py runs them).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from oscar_export.bench import random_artifact
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.plugins.hf import cache_kwargs, enable_oscar

from helpers import tiny_llama

LAYOUT = KVCacheLayout.default(2, 64, "channel", sink=16, window=64, page_size=64)


def _readme_loop(compiler: str, mode: str | None, steps: int) -> None:
    """Prefill two caches, then ``steps`` decode steps (crossing a demotion): compiled vs eager, same tokens. Keys
    rotated (a calibrated artifact's shape): the queries go through ``decode_append``'s rotation once a step."""
    model = tiny_llama()
    with torch.no_grad(), enable_oscar(model, random_artifact(model, seed=1, layout=LAYOUT, key_bits=(4, 2))) as oscar:
        assert oscar.ops.name == "torch"
        assert not any(layer.flags.keys_identity for layer in oscar.make_cache(1, 8).layers)
        eager, comp = oscar.make_cache(2, 400), oscar.make_cache(2, 400)
        ids = torch.randint(1, 96, (2, 150))
        tok = model(ids, **cache_kwargs(model, eager)).logits[:, -1:].argmax(-1)
        model(ids, **cache_kwargs(model, comp))
        step = torch.compile(model.forward, mode=mode, fullgraph=True, backend=compiler)
        pos = torch.full((2, 1), 150)
        for i in range(steps):
            got = step(tok, position_ids=pos, **cache_kwargs(model, comp)).logits
            want = model(tok, position_ids=pos, **cache_kwargs(model, eager)).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {i}: {m}")
            tok, pos = want[:, -1:].argmax(-1), pos + 1
        assert comp.sequence_lengths() == eager.sequence_lengths() == [150 + steps] * 2
        assert int(comp.layers[0].state.num_pages[0]) >= 1, "the steps crossed a demotion"


def test_readme_loop_fullgraph_on_cpu_reference():
    """The reference backend's decode step in one graph (Dynamo + AOT autograd, the custom-op-free reference ops),
    equal to eager over 30 steps that demote a page."""
    _readme_loop("aot_eager", None, 30)


@pytest.mark.slow
def test_readme_loop_inductor_reduce_overhead_on_cpu_reference():
    """The README's exact compile call (Inductor, ``mode="reduce-overhead"``) on the CPU reference backend
    (about 3 minutes of C++ compilation on a 2-core machine)."""
    _readme_loop("inductor", "reduce-overhead", 20)


class _Traced(Exception):
    pass


def _trace_only(gm, example_inputs):
    """A torch.compile backend that stops once Dynamo has traced the whole step: returns a callable that raises."""
    _trace_only.graphs.append(gm)

    def run(*args):
        raise _Traced

    return run


_trace_only.graphs = []


def traced_step(model, cache):
    """The FX graph Dynamo traces of one decode step of ``model`` on ``cache`` (``fullgraph=True``; nothing runs)."""
    _trace_only.graphs.clear()
    step = torch.compile(model.forward, fullgraph=True, backend=_trace_only)
    tok, pos = torch.ones(2, 1, dtype=torch.long), torch.full((2, 1), 150)
    with torch.no_grad(), pytest.raises(_Traced):
        step(tok, position_ids=pos, **cache_kwargs(model, cache))
    (gm,) = _trace_only.graphs
    return gm


def test_hopper_decode_step_traces_in_one_graph():
    """Bug (issue 26): with mma16 pages the README loop failed, Dynamo could not trace the Gluon wrapper's
    ``data_ptr() % 16`` check. Now the hopper backend's checks run when the cache is made and the step traced with
    ``fullgraph=True`` holds the two custom ops per layer and nothing host-side; with rotated keys each layer's
    ``oscar.decode_attention`` reads the queries its ``oscar.decode_append`` returned (the rotation once a step).
    (Tracing only: the kernels need an sm_90 GPU.)"""
    pytest.importorskip("triton")
    from oscar_export.kernels.decode import DecodeBackend, hopper

    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    model = tiny_llama(dtype=torch.bfloat16)
    with enable_oscar(model, random_artifact(model, seed=1, layout=LAYOUT, key_bits=(2, 2)), backend="triton") as oscar:
        from dataclasses import replace

        on_hopper = replace(oscar, decode_backends=(DecodeBackend("hopper"),) * 2)
        cache = on_hopper.make_cache(2, 400)
        assert [layer.layout.packing for layer in cache.layers] == ["mma16", "mma16"]
        assert all(layer.decode_plan.hopper_kernel for layer in cache.layers)
        gm = traced_step(model, cache)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "oscar" in str(n.target)]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "decode" in str(n.target)]
    assert [str(n.target) for n in nodes] == ["oscar.decode_append", "oscar.decode_attention"] * 2, ops
    # the step's lengths, then the committed ones: written by one opaque op each (test below)
    assert ops[0] == "oscar.write_split" and ops.count("oscar.write_split") == 2, ops
    for append, attention in zip(nodes[::2], nodes[1::2]):
        assert attention.args[0] is append, f"{attention} reads {attention.args[0]}, not what {append} returned"


_NO_TRITON = textwrap.dedent("""
    import sys, importlib.abc

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Block())
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from oscar_export.kernels.decode import select_backend
    from oscar_export.kernels.layout import KVCacheLayout
    from oscar_export.plugins.hf import cache_kwargs, enable_oscar

    lay = KVCacheLayout.default(2, 64, "channel", sink=16, window=64, page_size=64)
    assert select_backend(lay, "cuda:0", 4).why == "Triton is not installed"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad(), enable_oscar(model, layout=lay) as oscar:
        assert oscar.ops.name == "torch", oscar.ops.name
        cache = oscar.make_cache(1, 300)
        out = model.generate(torch.randint(1, 96, (1, 120)), max_new_tokens=80, do_sample=False,
                             **cache_kwargs(model, cache))
    assert out.shape == (1, 200) and cache.sequence_lengths() == [199], cache.sequence_lengths()
    assert "triton" not in sys.modules
    print("ok")
""")


def test_a_model_without_triton_installed_generates():
    """A CPU model where Triton cannot be imported (an import blocker in a child process): ``enable_oscar`` picks
    the reference backend and ``generate`` runs past a demotion; nothing imports Triton."""
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]


def test_every_cache_tensor_the_step_reads_is_a_static_input():
    """Bug (issue 26, the H200 profile of the README loop: ~260 device-to-device copies a step): CUDA-graph trees
    copy every graph input not marked static into the graph's buffers at each replay. The cache marked its windows,
    pools and book, not the layers' transform tensors nor the plans' removal counts (8 a layer). Every tensor of
    the cache the traced step reads must be marked (``torch._dynamo.mark_static_address``)."""
    pytest.importorskip("triton")
    from dataclasses import fields

    model = tiny_llama(dtype=torch.bfloat16)
    with enable_oscar(model, random_artifact(model, seed=1, layout=LAYOUT, key_bits=(4, 2)), backend="triton") as oscar:
        cache = oscar.make_cache(2, 400)
        mine = {}
        for layer in cache.layers:
            owners = [(f"transform.{f.name}", getattr(layer.transform, f.name)) for f in fields(layer.transform)]
            owners += [(f"append_plan.{f.name}", getattr(layer.append_plan, f.name)) for f in fields(layer.append_plan)]
            owners += [(f"state.{f.name}", getattr(layer.state, f.name)) for f in fields(layer.state)]
            owners += [(f"step_state.{f.name}", getattr(layer.step_state, f.name)) for f in fields(layer.step_state)]
            mine.update({id(t): f"layer {layer.index} {name}" for name, t in owners if isinstance(t, torch.Tensor)})
        mine.update({id(t): "book" for t in cache.book.tensors() + [cache.seen]})
        inputs = []

        def keep_inputs(gm, example_inputs):
            inputs.extend(example_inputs)
            raise _Traced

        step = torch.compile(model.forward, fullgraph=True, backend=keep_inputs)
        with torch.no_grad(), pytest.raises(Exception, match="_Traced"):
            step(torch.ones(2, 1, dtype=torch.long), position_ids=torch.full((2, 1), 150), **cache_kwargs(model, cache))
    read = [(mine[id(t)], t) for t in inputs if isinstance(t, torch.Tensor) and id(t) in mine]
    assert len(read) > 20, [name for name, _ in read]
    loose = [name for name, t in read if getattr(t, "_dynamo_static_input_type", None) is None]
    assert not loose, f"{len(loose)} of {len(read)} cache tensors the step reads are not static: {loose[:8]}"


def test_the_step_lengths_are_one_op_in_the_compiled_graph():
    """Bug (issue 26, the compile time): the page book's length split was plain tensor arithmetic in the step; in
    Inductor every attention launch that read the step's lengths got its own small kernel recomputing them from
    ``seq_len`` (five a layer), and its fusion pass compared those kernels pairwise across the layers (H200, Llama-3-8B
    shape: the scheduler 16.1 s against BF16's 7.3). Now ``PageBook`` writes each set of lengths with one opaque
    op, and the traced step writes none of the book's buffers with a ``copy_`` of its own."""
    model = tiny_llama(dtype=torch.bfloat16)
    with enable_oscar(model, random_artifact(model, seed=1, layout=LAYOUT, key_bits=(2, 2))) as oscar:
        gm = traced_step(model, oscar.make_cache(2, 400))
    splits = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == "oscar.write_split"]
    assert len(splits) == 2, gm.code
    copies = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "copy_"]
    assert not copies, [n.format_node() for n in copies]
