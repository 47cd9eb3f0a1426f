"""Tensor-parallel export on tiny random models: the ranks' files, their concatenation, and the real check — each
rank's v_proj/o_proj slices with that rank's artifact give its share of the attention output."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from oscar_export.calibration.artifact import ArtifactError, load_artifact  # noqa: E402
from oscar_export.checkpoint import ARTIFACT_DIR  # noqa: E402
from oscar_export.cli import main  # noqa: E402
from oscar_export.export import export_checkpoint  # noqa: E402
from oscar_export.kernels import reference  # noqa: E402
from oscar_export.tensor_parallel import (  # noqa: E402
    RANK_TENSORS,
    check_tp_export,
    load_rank,
    projection_names,
    rank_dir,
    rank_heads,
)

from helpers import logits, random_artifact, tiny_model  # noqa: E402

HEADS, KV_HEADS, D, LAYERS = 12, 6, 16, 2
#: tp sizes that fit 12 query / 6 KV heads: split (1, 2, 3) and replicated (12: each KV head on 2 ranks)
TPS = (1, 2, 3, 12)


def model_of(kind: str):
    model = tiny_model(kind, heads=HEADS, kv_heads=KV_HEADS, head_dim=D, layers=LAYERS)
    if kind == "qwen2":  # v_proj has a bias: make it non-zero so its slice is tested
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.v_proj.bias.normal_()
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def exported(request, tmp_path_factory):
    """One export per family with tp 1, 2 and 3 written beside it; also the original model's layer-0 attention."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"tp-{kind}")
    original = model_of(kind)
    ids = torch.randint(0, 97, (2, 32))
    io = attention_io(original, 0, ids)
    ref = logits(original, ids)
    art = random_artifact(original)
    ckpts = {}
    for tp in TPS:
        ckpts[tp] = export_checkpoint(model_of(kind), None, art, root / f"ckpt{tp}", tp=tp)
    return {"kind": kind, "ckpts": ckpts, "io": io, "ids": ids, "logits": ref, "original": original}


def attention_io(model, layer: int, ids: torch.Tensor) -> dict:
    """Input hidden states, RoPE (cos, sin) and output of ``model``'s layer-``layer`` attention on ``ids``."""
    attn = model.model.layers[layer].self_attn
    got = {}

    def pre(mod, args, kwargs):
        got["x"], got["pe"] = kwargs["hidden_states"].detach().clone(), kwargs["position_embeddings"]

    def post(mod, args, kwargs, out):
        got["out"] = out[0].detach().clone()

    hooks = [attn.register_forward_pre_hook(pre, with_kwargs=True), attn.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def fake_quantize(x: torch.Tensor, fmt, clip, levels, page: int) -> torch.Tensor:
    """``x [B, H_kv, T, D]`` stored rows through the reference quantizer, page by page (every row INT2)."""
    b, h, t, d = x.shape
    pages = x.reshape(b, h, t // page, page, d).transpose(1, 2).reshape(-1, h, page, d)  # [N, H_kv, P, D]
    codes, params = reference.quantize_pages(pages, fmt, clip, levels)
    back = reference.dequantize_pages(codes, params, fmt, levels)
    return back.reshape(b, t // page, h, page, d).transpose(1, 2).reshape(b, h, t, d)


def rank_share(original, io: dict, art, tensors: dict, layer: int, quantize: bool) -> torch.Tensor:
    """This rank's partial o_proj output ``[B, T, hidden]`` (fp64) from its own slices and artifact alone.

    q/k come from the original model's (unfolded) q_proj/k_proj rows of the rank's heads; v and the output
    projection from the rank's files. Keys, queries and values go into the stored basis with the rank's
    transforms (``LayerTransform``, values already folded), optionally through the INT2 reference quantizer.
    """
    tp = art.fingerprint["tensor_parallel"]
    (q0, q1), (k0, k1) = tp["query_heads"], tp["kv_heads"]
    attn = original.model.layers[layer].self_attn
    names = projection_names(_fold(original), layer)
    x = io["x"].double()  # [B, T, hidden]
    b, t, _ = x.shape
    with torch.no_grad():
        q = torch.nn.functional.linear(x, attn.q_proj.weight.double(), _double(attn.q_proj.bias))
        k = torch.nn.functional.linear(x, attn.k_proj.weight.double(), _double(attn.k_proj.bias))
        v = torch.nn.functional.linear(x, tensors[names["v_weight"]].double(), _double(tensors.get(names["v_bias"])))
    q = q.view(b, t, HEADS, D)[:, :, q0:q1].transpose(1, 2)  # [B, H/N, T, D]
    k = k.view(b, t, KV_HEADS, D)[:, :, k0:k1].transpose(1, 2)  # [B, H_kv/N, T, D]
    v = v.view(b, t, k1 - k0, D).transpose(1, 2).float()  # [B, H_kv/N, T, D], already in the rotated basis
    cos, sin = io["pe"]
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    tr = art.transforms[layer]
    qs, ks, vs = tr.transform_queries(q.float()), tr.transform_keys(k.float()), tr.transform_values(v)
    if quantize:
        lay = art.layout
        ks = fake_quantize(ks, lay.key, tr.k_clip, tr.k_levels, lay.page_size)
        vs = fake_quantize(vs, lay.value, tr.v_clip, tr.v_levels, lay.page_size)
    g = (q1 - q0) // (k1 - k0)
    ks, vs = ks.double().repeat_interleave(g, 1), vs.double().repeat_interleave(g, 1)  # [B, H/N, T, D]
    scores = torch.matmul(qs.double(), ks.transpose(-1, -2)) * D**-0.5  # [B, H/N, T, T]
    scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.matmul(torch.softmax(scores, -1), vs)  # [B, H/N, T, D] stored basis
    o = tr.restore_output(o.float()).double()  # + v_mean; still R_V-rotated: the rank's o_proj columns undo it
    return torch.matmul(o.transpose(1, 2).reshape(b, t, -1), tensors[names["o_weight"]].double().T)


def _double(t):
    return None if t is None else t.double()


def _fold(model):
    from oscar_export.calibration.families import family_for

    return family_for(model).family.fold


def ranks_of(ckpt, tp: int):
    """``[(artifact, projections)]`` of every rank."""
    loaded = [load_rank(rank_dir(ckpt, h)) for h in rank_heads(HEADS, KV_HEADS, tp)]
    return [(art, tensors) for art, _, tensors in loaded]


# ---- the files -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", TPS)
def test_ranks_concatenate_to_the_unsharded_export(exported, tp):
    ckpt = exported["ckpts"][tp]
    assert sorted(p.name for p in (ckpt / f"tp{tp}").iterdir()) == sorted(f"rank{r}" for r in range(tp))
    n = check_tp_export(ckpt, tp)
    kv = 10 + 1 + (exported["kind"] == "qwen2")  # per KV head: artifact fields, v_proj rows (and bias)
    replicas = tp - KV_HEADS if tp > KV_HEADS else 0  # ranks holding a second copy of a KV head
    assert n == LAYERS * (kv + replicas * kv + 1)  # + o_proj
    loaded = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert (logits(loaded, exported["ids"]) - exported["logits"]).abs().max().item() < 1e-4  # export unchanged


def test_check_finds_a_wrong_rank(exported, tmp_path):
    """The check compares tensors: swapping two ranks' projections (same shapes) is caught, naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported["ckpts"][3], ckpt)
    a, b = rank_dir(ckpt, rank_heads(HEADS, KV_HEADS, 3)[0]), rank_dir(ckpt, rank_heads(HEADS, KV_HEADS, 3)[2])
    ta, tb = load_file(str(a / RANK_TENSORS)), load_file(str(b / RANK_TENSORS))
    save_file(tb, str(a / RANK_TENSORS))
    save_file(ta, str(b / RANK_TENSORS))
    with pytest.raises(ValueError, match=r"tp 3: model\.layers\.0\.self_attn\.v_proj\.weight: the ranks give"):
        check_tp_export(ckpt, 3)

    # replicated KV heads (tp 12: KV head h on ranks 2h, 2h+1): a second copy that differs from the first is caught
    ckpt = tmp_path / "ckpt12"
    shutil.copytree(exported["ckpts"][12], ckpt)
    one, three = (rank_dir(ckpt, rank_heads(HEADS, KV_HEADS, 12)[r]) for r in (1, 3))
    t1, t3 = load_file(str(one / RANK_TENSORS)), load_file(str(three / RANK_TENSORS))
    v = "model.layers.0.self_attn.v_proj.weight"
    t1[v] = t3[v]
    save_file(t1, str(one / RANK_TENSORS))
    with pytest.raises(ValueError, match=r"tp 12: rank 1 replica of model\.layers\.0\.self_attn\.v_proj\.weight"):
        check_tp_export(ckpt, 12)


@pytest.mark.parametrize("tp", [2, 3, 12])
def test_rank_artifacts_load_and_validate(exported, tp):
    ckpt = exported["ckpts"][tp]
    full = load_artifact(ckpt / ARTIFACT_DIR)
    for heads, (art, tensors) in zip(rank_heads(HEADS, KV_HEADS, tp), ranks_of(ckpt, tp)):
        fp = art.fingerprint
        kv_per_rank, rep = max(KV_HEADS // tp, 1), max(tp // KV_HEADS, 1)
        assert (fp["num_attention_heads"], fp["num_key_value_heads"]) == (HEADS // tp, kv_per_rank)
        r = heads.rank
        assert fp["tensor_parallel"] == {"size": tp, "rank": r, "kv_replicas": rep,
                                         "kv_heads": [r // rep * kv_per_rank, (r // rep + 1) * kv_per_rank],
                                         "query_heads": [r * HEADS // tp, (r + 1) * HEADS // tp]}
        assert art.layout.num_kv_heads == kv_per_rank and all(t.values_prerotated for t in art.transforms)
        kv = slice(heads.kv_heads.start, heads.kv_heads.stop)
        assert torch.equal(art.transforms[1].k_rotation, full.transforms[1].k_rotation[kv])
        assert torch.equal(art.transforms[0].v_mean, full.transforms[0].v_mean[kv])
        names = projection_names(_fold(exported["original"]), 1)
        assert tensors[names["v_weight"]].shape == (kv_per_rank * D, 48)
        assert tensors[names["o_weight"]].shape == (48, HEADS // tp * D)
        # a rank is not the whole model: its artifact is refused for the unsharded config, naming the heads
        with pytest.raises(ArtifactError, match=f"num_key_value_heads: artifact {kv_per_rank}, model {KV_HEADS}"):
            load_artifact(rank_dir(ckpt, heads), exported["original"].config)


# ---- the real check: each rank's slices and transforms give its share of the attention output ---------------------


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("layer", [0, 1])
def test_rank_shares_sum_to_the_attention_output(exported, tp, layer):
    original, ckpt = exported["original"], exported["ckpts"][tp]
    io = exported["io"] if layer == 0 else attention_io(original, layer, exported["ids"])
    ranks = ranks_of(ckpt, tp)
    total = sum(rank_share(original, io, art, tensors, layer, quantize=False) for art, tensors in ranks)
    want = io["out"].double()  # the original model's attention output (o_proj has no bias in these families)
    err = (total - want).abs().max().item()
    print(f"{exported['kind']} tp {tp} layer {layer}: max |sum of shares - attention output| = {err:.3g} "
          f"(output scale {want.abs().max().item():.3g})")
    assert err < 1e-5 * max(1.0, want.abs().max().item())

    # with every key and value through the INT2 reference quantizer, the ranks' shares (each with its own
    # rotations, means, clips, levels) sum to the unsharded export's quantized output: a rank reading another
    # rank's transforms would quantize different rows
    full = ranks_of(exported["ckpts"][1], 1)[0]
    q_total = sum(rank_share(original, io, art, tensors, layer, quantize=True) for art, tensors in ranks)
    q_full = rank_share(original, io, *full, layer, quantize=True)
    q_err = (q_total - q_full).abs().max().item()
    assert q_err < 1e-9 * max(1.0, q_full.abs().max().item()), q_err
    assert (q_full - want).abs().max().item() > 100 * err  # the quantizer really ran (INT2 error >> fp rounding)


def test_swapped_rank_transforms_change_the_quantized_share(exported):
    """The quantized check above can fail: rank 0 read with rank 1's artifact gives another output."""
    original, ckpt = exported["original"], exported["ckpts"][2]
    (art0, t0), (art1, _) = ranks_of(ckpt, 2)
    right = rank_share(original, exported["io"], art0, t0, 0, quantize=True)
    wrong_art = type(art0)(art0.layout, art1.transforms, art0.fingerprint, art0.config, {})
    wrong = rank_share(original, exported["io"], wrong_art, t0, 0, quantize=True)
    assert (right - wrong).abs().max().item() > 1e-3 * right.abs().max().item()


# ---- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry,msg", [
    ({"size": 3, "rank": 3, "kv_heads": [6, 8], "query_heads": [12, 16], "kv_replicas": 1}, "with 0 <= rank < size"),
    ("rank 1", "with 0 <= rank < size"),
    ({"size": 3, "rank": 1, "kv_heads": [2, 4], "query_heads": [4, 8]}, "with 0 <= rank < size"),  # no kv_replicas
    ({"size": 3, "rank": 1, "kv_heads": [0, 2], "query_heads": [4, 8], "kv_replicas": 1},
     r"expected \{'size': 3, 'rank': 1, 'kv_heads': \[2, 4\]"),
    ({"size": 3, "rank": 1, "kv_heads": [2, 4], "query_heads": [4, 8], "kv_replicas": 3},
     "fingerprint.tensor_parallel: tensor parallelism: tp 3 does not fit the model's 2 KV heads"),  # 3 x 2 / 3
])
def test_load_rank_checks_its_heads(exported, tmp_path, entry, msg):
    import json
    import shutil

    d = tmp_path / "rank1"
    shutil.copytree(rank_dir(exported["ckpts"][3], rank_heads(HEADS, KV_HEADS, 3)[1]), d)
    meta = json.loads((d / "oscar.json").read_text())
    meta["fingerprint"]["tensor_parallel"] = entry
    (d / "oscar.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=msg):
        load_rank(d)
    with pytest.raises(ArtifactError, match="not a tensor-parallel rank"):
        load_rank(exported["ckpts"][3] / ARTIFACT_DIR)



def test_tp_that_does_not_divide_the_kv_heads_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"tp 4 does not fit the model's 6 KV heads \(H_kv\) and 12 query heads: "
                                         r"tp must divide H_kv, or \(TensorRT-LLM replicates KV heads when tp > H_kv\)"
                                         r" be a multiple of H_kv that divides the query heads; use tp in "
                                         r"\[1, 2, 3, 6, 12\]"):
        rank_heads(HEADS, KV_HEADS, 4)
    with pytest.raises(ValueError, match="tp 8 does not fit the model's 6 KV heads"):
        rank_heads(HEADS, KV_HEADS, 8)
    with pytest.raises(ValueError, match="tp 24 does not fit the model's 6 KV heads"):  # a multiple, but > H
        rank_heads(HEADS, KV_HEADS, 24)
    with pytest.raises(ValueError, match="expected a tp size >= 1, got 0"):
        rank_heads(HEADS, KV_HEADS, 0)
    model = model_of("llama")
    before = model.model.layers[0].self_attn.v_proj.weight.clone()
    with pytest.raises(ValueError, match="tp 4 does not fit the model's 6 KV heads"):
        export_checkpoint(model, None, random_artifact(model), tmp_path / "ckpt", tp=4)
    assert not any(tmp_path.iterdir())  # nothing written
    assert torch.equal(model.model.layers[0].self_attn.v_proj.weight, before)  # nothing folded


def test_cli_bad_tp_refused_before_model_load(tmp_path, capsys, monkeypatch):
    import oscar_export.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded before the --tp check"))
    random_artifact(model_of("llama")).save(tmp_path / "art")
    assert main(["export", "--artifact", str(tmp_path / "art"), "--out", str(tmp_path / "out"), "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp 4 does not fit the model's 6 KV heads" in err, err


def test_cli_writes_and_checks_the_ranks(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    model = model_of("llama")
    model.save_pretrained(tmp_path / "model")
    tk = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(tmp_path / "model")
    random_artifact(model).save(tmp_path / "art")
    rc = main(["export", "--model", str(tmp_path / "model"), "--artifact", str(tmp_path / "art"),
               "--out", str(tmp_path / "out"), "--tp", "2"])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "2 ranks; their 24 tensors concatenate to the unsharded export" in out, out
    assert (tmp_path / "out" / "tp2" / "rank1" / RANK_TENSORS).is_file()
    assert main(["inspect", str(tmp_path / "out" / "tp2" / "rank1")]) == 0
    out = capsys.readouterr().out
    assert "6 query / 3 KV heads" in out, out
    assert 'tp rank    {"kv_heads": [3, 6], "kv_replicas": 1, "query_heads": [6, 12], "rank": 1, "size": 2}' in out, out
