"""tests/calibration and tests/oscar_export: artifacts, model families, planted attention data."""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels.layout import KVCacheLayout

from helpers_models import random_artifact, randomize_biases_and_norms, tiny_model


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
