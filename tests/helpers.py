"""Test helpers shared by several test files (docs/design.md §2: one home): tiny random-weight models, a random
calibrated-looking transform and artifact, a character tokenizer, a tiny exported checkpoint."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from types import ModuleType

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout

#: the boundary-heavy shape grid (docs/design.md §8, STYLE "tests that can fail"): lengths around the windows for
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


# ---- Triton kernels where they can run: compiled on a GPU, interpreted on the CPU (tests/kernels, tests/plugins) ---
# Triton decides at import time whether ``@triton.jit`` functions (its own ``tl.max``/``tl.sum`` included) are
# interpreted (``TRITON_INTERPRET=1``), so one process cannot hold both modes, and the AOT tests need the compiled
# mode on the CPU. Without a GPU, the first test of a kernel test file therefore runs that whole file once in a
# child pytest process with ``TRITON_INTERPRET=1``; each test of the parent then reports its own outcome from the
# child (failures with the child's output). Library code never reads the variable; only this harness sets it, in
# the child's environment.

#: this process runs Triton kernels through the interpreter (the child of :func:`kernel_module`)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_child_results: dict[str, tuple[dict[str, str], str]] = {}


def _run_child(path: str, markexpr: str) -> tuple[dict[str, str], str]:
    """Run one test file under the interpreter; ``({test name: PASSED/FAILED/...}, output)``."""
    if path not in _child_results:
        env = dict(os.environ, TRITON_INTERPRET="1")
        marks = f"({markexpr}) and not gpu" if markexpr else "not gpu"
        cmd = [sys.executable, "-m", "pytest", path, "-q", "-rA", "-p", "no:cacheprovider", "-m", marks]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        out = proc.stdout + proc.stderr
        outcomes = {}
        for m in re.finditer(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\S* (\S+::\S+)", out, re.M):
            outcomes[m.group(2).split("::", 1)[1]] = m.group(1)
        _child_results[path] = (outcomes, out)
    return _child_results[path]


def kernel_module(request: pytest.FixtureRequest, name: str) -> ModuleType:
    """``oscar_export.kernels.<name>`` for a test that launches its kernels (a fixture's body): the module on a GPU or
    in the interpreted child; else the test ends here with its outcome in the child (see the comment above)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or INTERPRETED:
        return importlib.import_module(f"oscar_export.kernels.{name}")
    outcomes, out = _run_child(str(request.node.path), request.config.getoption("markexpr", "") or "")
    status = outcomes.get(request.node.name)
    if status == "PASSED":
        pytest.skip("passed in the TRITON_INTERPRET=1 child process (see tests/helpers.py: kernel_module)")
    if status == "SKIPPED":
        pytest.skip("skipped in the TRITON_INTERPRET=1 child process")
    pytest.fail(f"{status or 'no result'} in the TRITON_INTERPRET=1 child process:\n{out[-6000:]}", pytrace=False)


def kernel_fixture(name: str, what: str = ""):
    """A pytest fixture (assign it to the fixture's name in a conftest) giving :func:`kernel_module` ``(request,
    name)``: ``oscar_export.kernels.<name>`` as it runs here; ``what`` ends its docstring."""

    def fixture(request: pytest.FixtureRequest) -> ModuleType:
        return kernel_module(request, name)

    fixture.__doc__ = f"``kernels.{name}`` as it runs here (``helpers.kernel_module``){what}."
    return pytest.fixture(fixture)


# ---- exact comparisons of a Triton writer with the PyTorch reference (tests/kernels) ---------------------------


def assert_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """``torch.equal(got, want)``, or an ``AssertionError`` naming the number of mismatches and the first five as
    ``(index, got, want)``."""
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        pairs = [(idx, got[tuple(idx)].item(), want[tuple(idx)].item()) for idx in bad]
        raise AssertionError(f"{name}: {(got != want).sum().item()} mismatches, first (index, got, want): {pairs}")


def assert_quantizes_like_reference(qp, device, x: torch.Tensor, layout: KVCacheLayout, fmt, clip: torch.Tensor,
                                    levels: torch.Tensor, operand: str = "key", **options):
    """Quantize the pages ``x [N, H_kv, P, D]`` with the Triton wrapper ``qp.quantize_pages`` (``x`` in its own dtype,
    on ``device``, with the wrapper's ``options``) and with ``reference.quantize_pages`` (``x`` in fp32, where it
    is): codes, then params, must be equal (:func:`assert_equal`). Returns the reference's ``(codes, params)``."""
    from oscar_export.kernels import reference

    want_c, want_p = reference.quantize_pages(x.float(), fmt, clip, levels, operand)
    got_c, got_p = qp.quantize_pages(x.to(device), layout, fmt, clip.to(device), levels.to(device), operand=operand,
                                     **options)
    assert_equal("codes", got_c.cpu(), want_c.cpu())
    assert_equal("params", got_p.cpu(), want_p.cpu())
    return want_c, want_p


# ---- tests/calibration and tests/oscar_export: artifacts, model families, planted attention data -----------------
# Moved here from the test files that shared them (no test module imports another); test files import
# them under these names.


def artifact_config(**kw):
    """A tiny ``LlamaConfig``: 3 layers, 4 query / 2 KV heads of 16 (``kw`` overrides)."""
    from transformers import LlamaConfig

    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                intermediate_size=128, vocab_size=100, head_dim=16)
    base.update(kw)
    return LlamaConfig(**base)


def config_artifact(config=None, key_granularity="token", codebook=False):
    """An artifact of :func:`artifact_config` (or ``config``) with random rotations, scalings, means and clips in
    every layer, learned-looking key levels when ``codebook``, and a config and stats to round-trip."""
    from dataclasses import replace

    from oscar_export.calibration.artifact import OscarArtifact
    from oscar_export.calibration.fingerprint import model_fingerprint
    from oscar_export.kernels.transform import LayerTransform, hadamard

    config = config or artifact_config()
    fp = model_fingerprint(config)
    h, d = fp["num_key_value_heads"], fp["head_dim"]
    layout = KVCacheLayout.default(h, d, key_granularity=key_granularity)
    if codebook:
        layout = replace(layout, key=replace(layout.key, codebook=True))
    ts = []
    for _ in range(fp["num_hidden_layers"]):
        rk = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0].float()
        rv = (hadamard(d).float() @ torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0].float())
        lv = torch.tensor([0.0, 0.9, 2.1, 3.0]) if codebook else torch.tensor([0.0, 1.0, 2.0, 3.0])
        ts.append(LayerTransform(
            k_rotation=rk, v_rotation=rv, k_scale=torch.rand(h, d) + 0.5, v_scale=torch.rand(h, d) + 0.5,
            k_mean=torch.randn(h, d), v_mean=torch.randn(h, d), k_clip=torch.tensor([0.9, 1.0]),
            v_clip=torch.tensor([0.8, 0.95]), k_levels=lv.expand(h, 4).contiguous(),
            v_levels=torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(h, 4).contiguous(),
        ))
    return OscarArtifact(layout, ts, fp, {"method": "test", "seed": 0}, {"layer_error": [0.5, 0.25, 0.125]})


def assert_same_artifact(a, b) -> None:
    """Two artifacts are equal: layout, fingerprint, config, stats and every transform tensor (``torch.equal``)."""
    assert a.layout == b.layout and a.fingerprint == b.fingerprint and a.config == b.config and a.stats == b.stats
    for i, (ta, tb) in enumerate(zip(a.transforms, b.transforms, strict=True)):
        for name in ta.__dataclass_fields__:
            x, y = getattr(ta, name), getattr(tb, name)
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f"layer {i} {name}"


def tamper(tmp_path, edit_tensors=None, edit_meta=None, art=None):
    """Write ``art`` (default :func:`config_artifact`) to ``tmp_path`` with its tensors and metadata edited first
    (``write_files`` fills in the matching checksum); returns ``tmp_path``."""
    from oscar_export.calibration.artifact import write_files

    art = art or config_artifact()
    tensors, meta = art.tensors(), art.metadata("")
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    write_files(tmp_path, meta, tensors)
    return tmp_path


def small_artifact(layers: int = 2):
    """An identity artifact of a 2-KV-head, head_dim-16 Llama with small windows (sink 4, window 16, P 16)."""
    from transformers import LlamaConfig

    from oscar_export.calibration.artifact import OscarArtifact
    from oscar_export.calibration.fingerprint import model_fingerprint
    from oscar_export.kernels.transform import LayerTransform

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                      intermediate_size=64, vocab_size=50, head_dim=16)
    fp = model_fingerprint(cfg)
    layout = KVCacheLayout.default(2, 16, sink=4, window=16, page_size=16)
    ts = [LayerTransform.identity(2, 16, 0.9, 0.95) for _ in range(layers)]
    return OscarArtifact(layout, ts, fp, {"method": "test"}, {"layers": [None] * layers})


def written(tmp_path, edit_meta=None, edit_tensors=None, art=None):
    """:func:`small_artifact` (or ``art``) written to ``tmp_path / "art"`` with its metadata and tensors edited."""
    from oscar_export.calibration.artifact import write_files

    art = art or small_artifact()
    meta, tensors = art.metadata(""), art.tensors()
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    d = tmp_path / "art"
    write_files(d, meta, tensors)
    return d


def refused(path, match: str, seconds: float = 1.0, max_bytes: int = 4 << 20):
    """load_artifact(path) raises ArtifactError matching ``match`` within ``seconds`` and ``max_bytes`` traced."""
    import time
    import tracemalloc

    import pytest

    from oscar_export.calibration.artifact import load_artifact
    from oscar_export.calibration.artifact_format import ArtifactError

    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ArtifactError, match=match) as e:
            load_artifact(path)
    finally:
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert dt < seconds, f"took {dt:.2f} s"
    assert peak < max_bytes, f"peak traced allocation {peak:,} bytes"
    return e.value


#: the tiny models of every family (:func:`family_config`): their vocabulary and the keywords all share.
FAMILY_VOCAB = 96
FAMILY_COMMON = dict(vocab_size=FAMILY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                     eos_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
FAMILY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
#: kind -> (config class, model class, config keywords): the smallest config that exercises the family's features.
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, **FAMILY_MOE)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(pad_token_id=0)),  # its default pad id is outside the vocabulary
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(use_qk_norm=True, attention_bias=True, n_routed_experts=4, n_shared_experts=1,
                      first_k_dense_replace=1, **FAMILY_MOE)),
    # head_dim 256 (two 128-element groups per row), a query_pre_attn_scalar that is not head_dim
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=256, query_pre_attn_scalar=64, layer_types=["full_attention"] * 2)),
    # interleaved local layers (first and last layer slide, window 8 < the test prompts): a BF16 sliding cache
    "gemma3_sliding": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                       dict(head_dim=256, query_pre_attn_scalar=64, num_hidden_layers=3, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def family_config(kind: str, **kw):
    """The config of :data:`TINY_FAMILIES` ``kind`` (``kw`` overrides), built from the family's own config class."""
    import transformers

    cfg_cls, model_cls, extra = TINY_FAMILIES[kind]
    return getattr(transformers, cfg_cls)(**{**FAMILY_COMMON, **extra, **kw, "architectures": [model_cls]})


def family_model(kind: str, **kw):
    """A random-weight model of :func:`family_config` (fp32, eval), biases and norms random."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, TINY_FAMILIES[kind][1])(family_config(kind, **kw)).float().eval()
    return randomize_biases_and_norms(model)


class ByteTokenizer:
    """Bytes as token ids mod ``vocab`` (enough for the calibration data path; no vocabulary files needed)."""

    def __init__(self, vocab: int = FAMILY_VOCAB) -> None:
        self.vocab = vocab

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        return {"input_ids": torch.tensor([[b % self.vocab for b in text.encode()]])}


#: (layers, query heads, KV heads, head_dim) of :func:`capture_llama`.
CAPTURE_SHAPE = (2, 6, 2, 16)


def capture_llama():
    """A random-weight Llama of :data:`CAPTURE_SHAPE` (vocabulary 50, RoPE theta 100) for the capture tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    L, H, HKV, D = CAPTURE_SHAPE
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HKV, num_hidden_layers=L,
                      intermediate_size=64, vocab_size=50, head_dim=D, rope_theta=100.0)
    return LlamaForCausalLM(cfg).eval()


#: (H_kv, G, D, T, P) of :func:`planted`: KV heads, queries per KV head, head_dim, tokens, page size.
PLANTED_SHAPE = (2, 3, 32, 96, 16)


def planted(n: int, seed: int, disagree: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[n, H_kv*G, T, D]``, k, v ``[n, H_kv, T, D]`` of :data:`PLANTED_SHAPE`.

    Keys: two outlier channels with a large offset and variance, on top of small isotropic noise; queries:
    rank-3, living where the keys are quiet. Each KV head sees the same structure in its own random basis
    (``disagree``) or in a common one.
    """
    from oscar_export.calibration.rotation import random_orthogonal

    H_KV, G, D, T, _ = PLANTED_SHAPE
    g = torch.Generator().manual_seed(seed)
    basis = random_orthogonal(H_KV if disagree else 1, D, 7).float().expand(H_KV, D, D)
    kz = 0.3 * torch.randn(n, H_KV, T, D, generator=g)
    kz[..., :2] = 6.0 + 3.0 * torch.randn(n, H_KV, T, 2, generator=g)
    qz = torch.zeros(n, H_KV, G, T, D)
    qz[..., 4:7] = 2.0 * torch.randn(n, H_KV, G, T, 3, generator=g)
    qz[..., :2] = 0.05 * torch.randn(n, H_KV, G, T, 2, generator=g)
    vz = torch.randn(n, H_KV, T, D, generator=g)
    vz[..., 5] *= 8.0
    k = kz @ basis[None]
    v = vz @ basis[None]
    q = (qz @ basis[None, :, None]).reshape(n, H_KV * G, T, D)
    return q, k, v


def stats_and_objective(disagree=True, skip=0):
    """Streamed statistics (``LayerStats``) of 8 :func:`planted` sequences and the ``LayerObjective`` of 3
    held-out ones (another seed)."""
    from oscar_export.calibration.capture import HeldOut
    from oscar_export.calibration.covariance import LayerStats
    from oscar_export.calibration.objective import LayerObjective

    H_KV, _, D, _, P = PLANTED_SHAPE
    q, k, v = planted(8, 0, disagree)
    st = LayerStats(H_KV, D, "cpu")
    st.update(q, k, v, D**-0.5, skip)
    hq, hk, hv = planted(3, 1, disagree)
    obj = LayerObjective.build(HeldOut(hq, hk, hv, D**-0.5), skip, P, 0)
    return st, obj


def identity_artifact_with_stats():
    """An identity artifact of a 2-layer Llama (2 KV heads of 16) with per-layer calibration stats as ``calibrate``
    writes them (``vs_identity`` / ``vs_hadamard`` of each side): what ``inspect`` shows."""
    from transformers import LlamaConfig

    from oscar_export.calibration.artifact import OscarArtifact

    art = OscarArtifact.identity(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             num_hidden_layers=2, head_dim=16, vocab_size=10))
    side = {"vs_identity": 0.5, "vs_hadamard": 0.9}
    art.stats["layers"] = [{"k": side, "v": side}] * 2
    return art


def small_cfg(**kw):
    """A ``CalibrationConfig`` small enough to calibrate :func:`capture_llama`-sized models in seconds: 8 sequences of
    96 tokens (2 held out), sink 16, window 32, pages of 16 (``kw`` overrides)."""
    from oscar_export.calibration.config import CalibrationConfig

    base = dict(tokens=8 * 96, seq_len=96, heldout=2, batch_size=3, sink=16, window=32, page_size=16)
    base.update(kw)
    return CalibrationConfig(**base)


def files(d):
    """``{relative path: bytes}`` of every file under ``d``: what a test compares to prove nothing was touched."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def one_line(err: str, command: str) -> str:
    """``err`` is one ``oscar-export COMMAND: error: ...`` line without a traceback; returns it."""
    assert err.count("\n") == 1 and err.startswith(f"oscar-export {command}: error: "), err
    assert "Traceback" not in err
    return err


def own_copy(src, dest):
    """``shutil.copytree(src, dest)``; returns ``dest`` (a test's own copy of a module-scoped checkpoint)."""
    import shutil

    shutil.copytree(src, dest)
    return dest


@pytest.fixture
def art_dir(tmp_path):
    """A random artifact of :func:`tiny_model`, saved to ``tmp_path / "art"`` (a fixture: the conftests of
    tests/calibration and tests/oscar_export import it)."""
    d = tmp_path / "art"
    random_artifact(tiny_model()).save(d)
    return d


# ---- tests/kernels: shared inputs and checks of the Triton writer and decode-attention tests ----------------------
# Moved here from the test files that shared them (no test module imports another).

def random_transform(h: int, d: int, seed: int = 0):
    """A ``LayerTransform`` of ``h`` KV heads of ``d`` with a random key rotation, key scaling and key / value means
    (clip 0.9 / 0.95, uniform levels): what a writer fusing the basis change must get right."""
    from dataclasses import replace

    from oscar_export.kernels.transform import LayerTransform

    g = torch.Generator().manual_seed(seed)
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0].contiguous()
    base = LayerTransform.identity(h, d, k_clip=0.9, v_clip=0.95)
    return replace(base, k_rotation=rot, k_scale=0.5 + torch.rand(h, d, generator=g),
                   k_mean=0.1 * torch.randn(h, d, generator=g), v_mean=0.1 * torch.randn(h, d, generator=g))


#: the quantizer tests' clip per KV head (the third cuts half the group) and fitted 2-bit levels per KV head.
CLIPS = torch.tensor([1.0, 0.96, 0.5])
LEVELS = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 0.8, 2.2, 3.0], [0.0, 1.3, 1.7, 3.0]])


def quant_rows(n: int, h: int, p: int, d: int) -> torch.Tensor:
    """Gaussian rows with outliers, ties (coarse grid) and one constant group: the quantizer's hard cases."""
    x = torch.randn(n, h, p, d) * torch.linspace(0.1, 3.0, d)
    x[..., ::7] = torch.round(x[..., ::7] * 4) / 4  # ties in |x| (the clip rank) and on code boundaries
    x[0, 0, 0] = 0.5  # a constant row: scale 0
    x[:, :, 1, 3] = 40.0  # an outlier the clip must cut
    return x


def book_state(lay: KVCacheLayout, bsz: int, max_length: int, device, dtype=torch.bfloat16):
    """A page book of ``bsz`` slots of ``max_length`` tokens and its empty pool on ``device``: ``(book, state)``."""
    from oscar_export.kernels.layout import PagedKV
    from oscar_export.kernels.pages import PageBook

    book = PageBook(lay, bsz, max_length, device)
    st = PagedKV.allocate(lay, bsz, book.num_pool_pages, book.max_pages, device=device, dtype=dtype)
    return book, st


def decode_steps(append, lay, tr, book, st, steps, bsz, seed, transform_in_kernel=False):
    """``steps`` decode steps through ``append(state, k, v, status)``; returns the stored-basis rows fed."""
    g = torch.Generator().manual_seed(seed)
    fed_k, fed_v = [], []
    for _ in range(steps):
        shape = (bsz, lay.num_kv_heads, lay.head_dim)
        k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        book.begin(1)
        committed = book.state_view(st, book.committed)
        append(committed, k.to(book.device), v.to(book.device), book.status)
        book.commit(1)
        if transform_in_kernel:
            k = tr.transform_keys(k.unsqueeze(2)).squeeze(2)
            v = v - tr.v_mean
        fed_k.append(k)
        fed_v.append(v)
    return torch.stack(fed_k, 2), torch.stack(fed_v, 2)  # [B, H_kv, steps, D]


#: the buffers of a ``PagedKV`` that a cache write fills.
BUFFERS = ("sink_k", "sink_v", "recent_k", "recent_v", "k_codes", "k_params", "v_codes", "v_params")


def appends_equal_reference(ds, device, lay, tr, bsz, steps, max_length, seed, what, check=None):
    """``steps`` decode appends through the reference (CPU) and the Triton writer ``ds.decode_append``
    (``device``) from the same tokens; ``check(book_r, st_r, st_g)`` runs before every buffer is compared (equal,
    named by ``what``). Returns both books."""
    from oscar_export.kernels import reference as ref

    book_r, st_r = book_state(lay, bsz, max_length, "cpu")
    book_g, st_g = book_state(lay, bsz, max_length, device)
    decode_steps(lambda s, k, v, status: ref.decode_append(s, k, v, status, lay, tr), lay, tr, book_r, st_r,
                 steps, bsz, seed=seed)
    trd = tr.to(device)
    decode_steps(lambda s, k, v, status: ds.decode_append(s, k, v, status, lay, trd), lay, tr, book_g, st_g,
                 steps, bsz, seed=seed)
    if check is not None:
        check(book_r, st_r, st_g)
    for f in BUFFERS:
        assert_equal(f"{what} {f}", getattr(st_g, f).cpu(), getattr(st_r, f))
    return book_r, book_g


def ragged_cache(lay: KVCacheLayout, lengths: list[int], tr, spare_pages: int = 1):
    """A ragged batch (``PagedKV``) written through the reference (page ids shuffled so the block table matters)."""
    from oscar_export.kernels import reference as ref
    from oscar_export.kernels.layout import PagedKV

    h, d = lay.num_kv_heads, lay.head_dim
    max_pages = max(1, max(lay.pages_for(t) for t in lengths)) + spare_pages
    pool = len(lengths) * max_pages
    st = PagedKV.allocate(lay, len(lengths), pool, max_pages)
    free = torch.randperm(pool).tolist()
    scale = torch.linspace(0.3, 2.0, d)  # uneven channels, like real keys
    for b, t in enumerate(lengths):
        if t:
            k = torch.randn(h, t, d) * scale + 0.3
            v = torch.randn(h, t, d)
            ref.append_tokens(st, b, k, v, lay, tr, free.pop)
    return st


def attention_errors(got: torch.Tensor, q: torch.Tensor, st, lay: KVCacheLayout, tr, scale: float):
    """(kernel error, BF16 PyTorch error) against fp64, max abs over all outputs; plus the fp64 output."""
    from oscar_export.kernels import reference as ref

    k, v, valid = ref.gather_context(st, lay, tr.k_levels, tr.v_levels)  # [B, H_kv, T, D] fp32, [B, T]
    b, hq, d = q.shape
    hkv = lay.num_kv_heads
    mask = valid[:, None, None, :]

    def attend(qq, kk, vv, dt):
        qg = qq.to(dt).reshape(b, hkv, hq // hkv, d)
        s = torch.matmul(qg, kk.to(dt).transpose(-1, -2)).double() * scale
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        o = torch.matmul(p.to(dt), vv.to(dt))
        return o.reshape(b, hq, d).double()

    want = attend(q, k, v, torch.float64)
    bf16 = attend(q, k, v, torch.bfloat16)
    return (got.double().cpu() - want).abs(), (bf16 - want).abs().max().item(), want


def check_attention_budget(got, q, st, lay, tr, scale, what=""):
    """The decode-attention error budget (flash-attention's rule): ``got``'s max error against fp64 at
    most 2x a BF16 PyTorch computation's of the same attention over the same cache, plus 1e-5; on failure the
    five worst outputs. Returns ``(kernel error, BF16 error)``."""
    err, err_bf16, want = attention_errors(got, q, st, lay, tr, scale)
    budget = 2 * err_bf16 + 1e-5
    if not err.max().item() <= budget:
        flat = err.flatten().topk(5)
        idx = [torch.unravel_index(i, err.shape) for i in flat.indices]
        rows = [(tuple(int(j) for j in ix), float(got.cpu()[ix]), float(want[ix])) for ix in idx]
        raise AssertionError(f"{what}: max error {err.max().item():.3e} > budget {budget:.3e} "
                             f"(BF16 error {err_bf16:.3e}); worst (index, got, fp64): {rows}")
    return err.max().item(), err_bf16


def build_probe_bundle(out, cache, archs=None):
    """``build_bundle`` of the probe kernels (kernels/aot/probe.py) into ``out`` for ``archs`` (default: every
    target), with a private Triton cache ``cache`` so the compile really runs (not a cache hit). Returns ``out``."""
    import os

    from oscar_export.kernels.aot.compile import DEFAULT_ARCHS, build_bundle
    from oscar_export.kernels.aot.probe import probe_specs

    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    try:
        return build_bundle(probe_specs(), out, archs=DEFAULT_ARCHS if archs is None else archs)
    finally:
        if old is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = old


def hopper_wrapper():
    """The hopper decode kernel's wrapper module (``kernels/decode/hopper.py``), skipped without Gluon."""
    hopper = pytest.importorskip("oscar_export.kernels.decode.hopper")
    if not hopper.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    return hopper


def hopper_split_spec(gran, d, p, gq, key_bits=2):
    """The ``KernelSpec`` of the hopper split kernel (launch plan ``DECODE_SPLIT_GL``) for 8 KV heads of ``d`` in
    mma16 pages of ``p`` tokens, ``gq`` query heads per KV head, ``key_bits`` keys, with the plan's register cap."""
    from oscar_export.kernels.aot.launch_plan import DECODE_SPLIT_GL, decode_split_gl_constexprs, gl_occupancy
    from oscar_export.kernels.aot.spec import KernelSpec
    from oscar_export.kernels.decode import hopper_kernel

    lay = KVCacheLayout.default(8, d, key_granularity=gran, packing="mma16", page_size=p).with_key_bits(key_bits)
    cx = decode_split_gl_constexprs(lay, 8 * gq, d**-0.5)
    assert cx["KEY_BITS"] == key_bits
    cx.update(STAGES=hopper_kernel.STAGES)
    return KernelSpec.from_plan(DECODE_SPLIT_GL, f"decode_split_gl_{gran}_d{d}_p{p}_g{gq}_k{key_bits}", cx,
                                maxnreg=gl_occupancy(d)[0])


def mma_layout(codebook=False):
    """2 KV heads of 64 in mma16 pages of 64 (token keys, sink 16, window 64), fitted levels if ``codebook``."""
    from oscar_export.kernels.layout import RowFormat

    return KVCacheLayout(2, 64, RowFormat(64, 64, "token", codebook=codebook, packing="mma16"),
                         RowFormat(64, 64, codebook=codebook, packing="mma16"), sink=16, window=64, page_size=64)


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

