"""The OSCAR AutoDeploy backend (plugins/autodeploy/) on stand-ins of TensorRT-LLM's AutoDeploy interface
(tests/plugins/autodeploy_standins.py, from upstream @086f0cea): registration, the declared cache resources, and
steps through the transformed graph compared with the reference cache ops driven directly
(tests/plugins/autodeploy_driver.py). Nothing here ran in TensorRT-LLM."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch

from oscar_export.kernels.layout import PagedKV
from oscar_export.plugins.autodeploy import register
from oscar_export.plugins.autodeploy.resources import CACHE_NAMES
from oscar_export.plugins.trtllm.reference_ops import TorchCacheOps

import autodeploy_standins as ads
from autodeploy_driver import Reference, Runner, Seq, TinyModel
from helpers import (
    MIXED_KEY_BITS,
    TRTLLM_HEADS,
    TRTLLM_LAYOUT,
    attention_oracle,
    expected_contents,
    trtllm_bundle,
    trtllm_checkpoint,
)
from helpers_models import rotated_transform

pytestmark = pytest.mark.usefixtures("one_thread")

P, MAX_SEQ, MAX_BATCH, BLOCKS = TRTLLM_LAYOUT.page_size, 128, 3, 40


def make_checkpoint(root, key_bits=()):
    """A checkpoint whose artifact has random rotations, scales, means and clipping in every layer."""
    from oscar_export.calibration.artifact import load_artifact

    ckpt = trtllm_checkpoint(root / "ckpt", key_bits=key_bits)
    art = load_artifact(ckpt / "oscar")
    ts = [rotated_transform(2, 64, seed=10 + i, prerotated=True) for i in range(art.num_layers)]
    shutil.rmtree(ckpt / "oscar")
    replace(art, transforms=tuple(ts)).save(ckpt / "oscar")
    return ckpt


def make_deployment(root, key_bits=()):
    """An ``OscarDeployment`` of :func:`make_checkpoint` with a fake bundle (the ops are the reference's)."""
    from oscar_export.plugins.trtllm.deployment import OscarDeployment

    bundle = trtllm_bundle(root / "kernels", key_bits=key_bits or None)
    return OscarDeployment(make_checkpoint(root, key_bits), bundle, arch="sm_90")


def reference_ops(lay):
    return TorchCacheOps(lay, TRTLLM_HEADS, 64 ** -0.5)


@pytest.fixture(params=["2-bit", "4-bit keys in layer 0"])
def backend(request, tmp_path):
    """``(interface stand-in, deployment, model, ops)`` with the ``"oscar"`` backend registered."""
    dep = make_deployment(tmp_path, () if request.param == "2-bit" else MIXED_KEY_BITS)
    up = ads.attention_interface()
    register(dep, up, reference_ops)
    model = TinyModel(dep.num_layers, dep.num_heads, 2, 64, dep.sm_scale)
    return up, dep, model, [reference_ops(lay) for lay in dep.layer_layouts]


def runner(backend, **kw):
    up, dep, model, _ = backend
    return Runner(model, up, MAX_BATCH, MAX_SEQ, P, BLOCKS, **kw)


def check(got, want, what):
    assert got.shape == want.shape, what
    bad = (got != want) & ~(got.isnan() & want.isnan())
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} differ, worst {(got - want).abs().max()}"


# ---- registration and resources ------------------------------------------------------------------------------


def test_registered_under_one_name(tmp_path):
    dep = make_deployment(tmp_path)
    up = ads.attention_interface()
    cls = register(dep, up, reference_ops)
    assert list(up.AttentionRegistry._attention_registry) == ["oscar"] and up.AttentionRegistry.get("oscar") is cls
    assert issubclass(cls, up.AttentionDescriptor) and cls.get_attention_layout() == "bsnd"
    with pytest.raises(ValueError, match="backend 'oscar' is already registered"):
        register(dep, up, reference_ops)


def test_cache_resources_are_the_oscar_pools(backend):
    """Per layer: the BF16 windows per sequence slot, the pools per AutoDeploy block in that layer's layout (4-bit
    key codes where key_bits say so), the non-finite flag; the pools count in the cache resize per token."""
    up, dep, *_ = backend
    r = runner(backend)
    assert r.replaced == dep.num_layers
    slots = r.cm.info.max_num_state_slots
    for layer, lay in enumerate(dep.layer_layouts):
        want = PagedKV.allocate(lay, slots, BLOCKS, 1)
        handlers = {n.rsplit("_", 1)[0]: h for n, h in r.cm._resource_lookup.items() if n.endswith(f"_{layer}")}
        assert tuple(handlers) == CACHE_NAMES
        for name in CACHE_NAMES[:-1]:
            got = r.cache(name, layer)
            assert (got.shape, got.dtype) == (getattr(want, name).shape, getattr(want, name).dtype), (layer, name)
        assert r.cache("nonfinite", layer).shape == (slots, 1)
        paged = [h for h in handlers.values() if h.is_paged]
        assert len(paged) == 4 and sum(h.bytes_per_token for h in paged) * P == lay.page_bytes()
    assert dep.layer_layouts[0].key.bits == r.cache("k_codes", 0).shape[-1] * 8 // 64


def test_tokens_per_block_must_be_the_page_size(backend):
    up, dep, model, _ = backend
    with pytest.raises(ValueError, match="tokens_per_block 32: the OSCAR cache needs tokens_per_block = its page size"):
        Runner(model, up, MAX_BATCH, MAX_SEQ, 2 * P, BLOCKS)


# ---- steps against the reference ------------------------------------------------------------------------------


def test_prompt_then_decode_steps_equal_the_reference(backend):
    """One sequence: a prompt past the sink, then decode steps through several demotions; bit-exact."""
    _, dep, model, ops = backend
    r, ref, seq = runner(backend), Reference(model, dep, ops, MAX_SEQ), Seq(slot=1)
    prompt = [(7 * i) % 50 for i in range(21)]
    check(r.step([(seq, prompt)])[0], ref.step(prompt), "prompt")
    for i in range(40):  # 21 + 40 tokens: recent window full at 48, pages demoted at 49, 65, ...
        tok = [(3 * i + 1) % 50]
        check(r.step([(seq, tok)])[0], ref.step(tok), f"decode step {i}")


def test_decode_attention_matches_an_fp64_oracle(backend):
    """Independent of the cache ops: each layer's decode output, at lengths around the windows and pages, equals
    fp64 attention over the sequence as the layout stores it (sink and recent rows as written, history pages
    quantized and dequantized: ``expected_contents``), to the BF16 rounding of the op's output."""
    _, dep, model, _ = backend
    r, seq = runner(backend), Seq(1)
    seen = []
    r.step([(seq, [(7 * i) % 50 for i in range(30)])], seen=seen)
    for i in range(40):
        r.step([(seq, [(3 * i + 1) % 50])], seen=seen)
        for layer, q, k, v, got in seen[-dep.num_layers :]:
            t, lay = dep.transform(layer, "cpu"), dep.layer_layouts[layer]
            ks = torch.cat([c[2].reshape(-1, 2, 64) for c in seen if c[0] == layer]).transpose(0, 1)  # [H_kv, T, D]
            vs = torch.cat([c[3].reshape(-1, 2, 64) for c in seen if c[0] == layer]).transpose(0, 1)
            k_s = t.transform_keys(ks[None])[0].to(torch.bfloat16).float()  # stored as the cache stores it
            v_s = t.transform_values(vs[None])[0].to(torch.bfloat16).float()
            kk, vv = expected_contents(lay, t, k_s, v_s)
            want = attention_oracle(q.reshape(-1, 64)[:, None], kk, vv, t, dep.sm_scale)  # [H, 1, D]
            torch.testing.assert_close(got.reshape(-1, 64).float(), want[:, 0], atol=1e-2, rtol=1e-2,
                                       msg=lambda m: f"length {31 + i}, layer {layer}: {m}")


def test_two_sequences_of_different_lengths_in_one_batch(backend):
    """A prompt batch of two (37 and 53 tokens), decode steps of both, then a new prompt in the same forward as their
    decode rows; pages handed out in shuffled order."""
    _, dep, model, ops = backend
    r = runner(backend, seed=3)
    a, b, c = Seq(0), Seq(2), Seq(1)
    ra, rb, rc = (Reference(model, dep, ops, MAX_SEQ) for _ in range(3))
    # every sequence reaches INT2 pages (S0 16 + W+P 32: the first page at 49 tokens), each in pages of its own
    pa, pb, pc = [i % 50 for i in range(37)], [(3 * i + 2) % 50 for i in range(53)], [(5 * i) % 50 for i in range(40)]
    got = r.step([(a, pa), (b, pb)])
    check(got[0], ra.step(pa), "prompt a")
    check(got[1], rb.step(pb), "prompt b")
    for i in range(30):
        ta, tb = [(i + 3) % 50], [(2 * i) % 50]
        rows = [(a, ta), (b, tb)]
        if i == 6:
            rows.insert(0, (c, pc))
        elif i > 6:
            rows.append((c, [(i * 7) % 50]))
        got = r.step(rows)
        refs = {id(a): ra, id(b): rb, id(c): rc}
        for (seq, toks), g in zip(rows, got):
            check(g, refs[id(seq)].step(toks), f"step {i}, slot {seq.slot}")


def test_a_slot_reused_after_a_finished_sequence(backend):
    """Sequence a fills slot 0 past several pages and finishes; b starts in slot 0 (AutoDeploy's input_pos 0) and
    equals a fresh reference, though the slot's windows and its old pages hold a's tokens. The allocation's garbage
    (``torch.empty``: here NaN windows and a set non-finite flag) is never read either."""
    _, dep, model, ops = backend
    r = runner(backend)
    for layer in range(dep.num_layers):
        for name in ("sink_k", "sink_v", "recent_k", "recent_v"):
            r.cache(name, layer).fill_(float("nan"))
        r.cache("nonfinite", layer).fill_(1)
    a, ra = Seq(0), Reference(model, dep, ops, MAX_SEQ)
    pa = [i % 50 for i in range(40)]
    check(r.step([(a, pa)])[0], ra.step(pa), "prompt a")
    for i in range(25):
        check(r.step([(a, [i % 50])])[0], ra.step([i % 50]), f"a step {i}")
    r.finish(a)
    b, rb = Seq(0), Reference(model, dep, ops, MAX_SEQ)
    pb = [(11 * i) % 50 for i in range(9)]
    check(r.step([(b, pb)])[0], rb.step(pb), "prompt b")
    for i in range(45):
        check(r.step([(b, [(i + 5) % 50])])[0], rb.step([(i + 5) % 50]), f"b step {i}")


def test_a_nonfinite_token_is_not_committed(backend):
    """A NaN key in one sequence's decode step, then in another's prompt: those sequences return NaN from then on
    and their caches are not written; the other sequence of the batch goes on equal to the reference; a new
    sequence in the slot starts clean."""
    _, dep, model, ops = backend
    r = runner(backend)
    a, b = Seq(0), Seq(1)
    ra, rb = Reference(model, dep, ops, MAX_SEQ), Reference(model, dep, ops, MAX_SEQ)
    pa, pb = [i % 50 for i in range(20)], [(3 * i) % 50 for i in range(30)]
    got = r.step([(a, pa), (b, pb)])
    check(got[0], ra.step(pa), "prompt a")
    check(got[1], rb.step(pb), "prompt b")
    with torch.no_grad():
        r.gm.emb[49] = float("nan")  # token 49: NaN hidden states, keys and values in every layer
    before = r.cache("recent_k", 0)[0].clone()
    got = r.step([(a, [49]), (b, [4])])
    assert got[0].isnan().all() and torch.equal(r.cache("recent_k", 0)[0], before)
    check(got[1], rb.step([4]), "b beside the NaN step")
    d = Seq(2)  # a prompt with the NaN token: nothing of it is written, its slot is flagged
    got = r.step([(d, [1, 2, 49, 3, 4]), (a, [0]), (b, [0])])
    check(got[2], rb.step([0]), "b beside a NaN prompt")
    assert got[0][2:].isnan().all() and got[1].isnan().all()
    assert not r.cache("sink_k", 0)[2].isnan().any() and int(r.cache("nonfinite", 0)[2]) == 1
    for i in range(1, 3):
        got = r.step([(a, [i]), (b, [i]), (d, [i])])
        assert got[0].isnan().all() and got[2].isnan().all(), "a sequence with a hole in its cache gave numbers"
        check(got[1], rb.step([i]), f"b step {i}")
    got = r.step([(a, [5, 6, 7]), (b, [3])])  # a later chunk of a flagged sequence: NaN, nothing written
    assert got[0].isnan().all()
    check(got[1], rb.step([3]), "b beside a flagged chunk")
    r.finish(a)
    c, rc = Seq(0), Reference(model, dep, ops, MAX_SEQ)
    check(r.step([(c, pa)])[0], rc.step(pa), "prompt c in a's slot")
    check(r.step([(c, [1])])[0], rc.step([1]), "c decode")


def test_a_prompt_in_chunks(backend):
    """A prompt in three chunks (input_pos 0, 20, 40: the later ones attend to the cache as stored, INT2 pages
    included), then decode steps; beside another sequence's decode rows."""
    _, dep, model, ops = backend
    r = runner(backend)
    a, b = Seq(1), Seq(0)
    ra, rb = Reference(model, dep, ops, MAX_SEQ), Reference(model, dep, ops, MAX_SEQ)
    pb = [(i * 13) % 50 for i in range(30)]
    check(r.step([(b, pb)])[0], rb.step(pb), "prompt b")
    prompt = [(7 * i + 3) % 50 for i in range(57)]
    for lo, hi in ((0, 20), (20, 40), (40, 57)):
        got = r.step([(a, prompt[lo:hi]), (b, [lo % 50])])
        check(got[0], ra.step(prompt[lo:hi]), f"chunk {lo}..{hi}")
        check(got[1], rb.step([lo % 50]), f"b beside chunk {lo}")
    for i in range(5):
        check(r.step([(a, [i])])[0], ra.step([i]), f"a step {i}")


def test_a_chunk_without_a_chunk_kernel_is_refused(tmp_path):
    """The AOT bundle has no kernel for a chunk after cached tokens: one line, not a wrong answer."""

    class NoChunks(TorchCacheOps):
        chunked_prefill = False

    dep = make_deployment(tmp_path)
    up = ads.attention_interface()
    register(dep, up, lambda lay: NoChunks(lay, TRTLLM_HEADS, 64 ** -0.5))
    r = Runner(TinyModel(dep.num_layers, dep.num_heads, 2, 64, dep.sm_scale), up, MAX_BATCH, MAX_SEQ, P, BLOCKS)
    a = Seq(0)
    r.step([(a, list(range(20)))])
    with pytest.raises(NotImplementedError, match="a prompt chunk after cached tokens: .* turn chunked prefill off"):
        r.step([(a, list(range(5)))])


def test_the_graph_traces_with_fake_tensors(backend):
    """The transformed graph runs under fake tensors (the cached op's and prepare_metadata's fake implementations),
    as AutoDeploy's shape propagation and export-time passes run it."""
    r = runner(backend)
    r.cm.info.nest_sequences([[1, 2, 3]], [0], [0], [1], [0])
    ads.fake_propagate(r.gm, *r.cm.named_args.values())
    outs = [n for n in r.gm.graph.nodes if n.op == "output"]
    assert tuple(outs[0].args[0].meta["val"].shape) == (1, 3, 32)


# ---- bad input: one line each --------------------------------------------------------------------------------


def test_a_model_with_another_softmax_scale_is_refused(backend):
    up, dep, _, _ = backend
    model = TinyModel(dep.num_layers, dep.num_heads, 2, 64, scale=0.2)
    with pytest.raises(ValueError, match="attention node 0: softmax scale 0.2; the OSCAR deployment's is 0.125"):
        Runner(model, up, MAX_BATCH, MAX_SEQ, P, BLOCKS)


def test_a_model_with_more_attention_layers_is_refused(backend):
    up, dep, _, _ = backend
    model = TinyModel(dep.num_layers + 1, dep.num_heads, 2, 64, dep.sm_scale)
    with pytest.raises(ValueError, match=f"attention node {dep.num_layers}: the OSCAR artifact has {dep.num_layers}"):
        Runner(model, up, MAX_BATCH, MAX_SEQ, P, BLOCKS)


def test_a_model_with_other_heads_is_refused(backend):
    up, dep, _, _ = backend
    model = TinyModel(dep.num_layers, dep.num_heads, 1, 64, dep.sm_scale)
    with pytest.raises(ValueError, match="attention node 0: q .*; the OSCAR deployment has 4 heads, 2 KV heads x 64"):
        Runner(model, up, MAX_BATCH, MAX_SEQ, P, BLOCKS)


def test_batch_info_of_both_interface_copies():
    """@086f0cea's three counts, and the later copy's twelve-slot BatchInfo (extend rows are context rows)."""
    from oscar_export.plugins.autodeploy.metadata import batch_counts

    assert batch_counts(torch.tensor([2, 40, 3], dtype=torch.int32)) == (2, 40, 3)
    later = torch.tensor([1, 20, 2, 7, 3, 3, 128, 8, 0, 4, 6, 1], dtype=torch.int32)
    assert batch_counts(later) == (3, 27, 3)
    with pytest.raises(ValueError, match="batch_info_host: expected 3 or 12 entries, got 4"):
        batch_counts(torch.zeros(4, dtype=torch.int32))


def test_an_unbound_deployment_is_named(backend):
    from oscar_export.plugins.autodeploy.binding import bound

    with pytest.raises(KeyError, match="binding 'nowhere' is not registered in this process"):
        bound("nowhere")
    assert math.isclose(bound("oscar").deployment.sm_scale, 0.125)


# ---- on a GPU, through the deployment's AOT bundle (NOT RUN on the machine this was written on) -----------------


@pytest.mark.gpu
def test_on_a_gpu_through_the_aot_bundle_as_the_reference_does(tmp_path):
    """The backend with its default ops (``deployment.ops``: ``AotCacheOps`` over a bundle compiled here for this GPU)
    against the reference cache ops on the same GPU: two sequences, prompts and 40 decode steps (demotions). The AOT
    decode returns BF16 attention (the reference float32) and the prompt is quantized by the bundle's kernels, so
    the hidden states (magnitude ~1) agree to a BF16 rounding carried through two layers, not bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cuda.bindings")
    from oscar_export.kernels.aot.bundle import serving_specs
    from oscar_export.kernels.aot.compile import build_bundle
    from oscar_export.plugins.trtllm.deployment import OscarDeployment

    cuda = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{10 * major + minor}"
    specs = serving_specs(TRTLLM_LAYOUT, TRTLLM_HEADS, 64 ** -0.5, probes=False, trt=False)
    bundle = build_bundle(specs, tmp_path / "kernels", archs=[arch], ptx_version=None)
    dep = OscarDeployment(make_checkpoint(tmp_path), bundle, arch=arch)
    up = ads.attention_interface()
    register(dep, up)
    model = TinyModel(dep.num_layers, dep.num_heads, 2, 64, dep.sm_scale).to(cuda)
    r = Runner(model, up, MAX_BATCH, MAX_SEQ, P, BLOCKS)
    ops = [TorchCacheOps(lay, TRTLLM_HEADS, dep.sm_scale) for lay in dep.layer_layouts]
    a, b = Seq(0), Seq(2)
    ra, rb = Reference(model, dep, ops, MAX_SEQ), Reference(model, dep, ops, MAX_SEQ)
    pa, pb = [i % 50 for i in range(37)], [(3 * i + 2) % 50 for i in range(21)]
    steps = [[(a, pa), (b, pb)]] + [[(a, [i % 50]), (b, [(2 * i) % 50])] for i in range(40)]
    for n, rows in enumerate(steps):
        got = r.step(rows)
        for (seq, toks), g, ref in zip(rows, got, (ra, rb)):
            torch.testing.assert_close(g, ref.step(toks), atol=2e-2, rtol=2e-2, msg=lambda m: f"step {n}: {m}")
