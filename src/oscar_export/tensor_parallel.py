"""Tensor-parallel export: each rank's share of an exported checkpoint, as TensorRT-LLM's tensor parallelism splits it.

With tensor parallelism of size N, rank r owns the query heads ``[r*H/N, (r+1)*H/N)`` and the KV heads they
read (query head ``j`` reads KV head ``j // g``, ``g = H / H_kv``, transformers' ``repeat_kv``):

* N divides H_kv: the KV heads ``[r*H_kv/N, (r+1)*H_kv/N)``, each on one rank;
* N a multiple of H_kv (N > H_kv): KV head ``r // (N / H_kv)``, replicated on ``N / H_kv`` consecutive ranks —
  what TensorRT-LLM does (``tensorrt_llm/_torch/models/modeling_utils.py::duplicate_kv_weight``: KV heads that
  tp does not divide are repeated when tp is a multiple of them);
* anything else is refused (:func:`rank_heads`), as TensorRT-LLM refuses it.

``v_proj`` is column-parallel (a rank holds the output rows of its KV heads), ``o_proj`` row-parallel (a rank
holds the input columns of its query heads; the ranks' partial outputs are summed by the all-reduce, and
``o_proj``'s bias, if any, is added once after it: it is not part of a rank's share).

``oscar-export export --tp N`` writes, beside the normal checkpoint::

    out/tp{N}/rank{r}/oscar.json, rotations.safetensors   the artifact of rank r's KV heads (rotations, scalings,
                                                          means, clips, levels; values_prerotated), read by
                                                          ``calibration.artifact.load_artifact``; its fingerprint
                                                          has the per-rank head counts and a ``"tensor_parallel"``
                                                          entry (:meth:`RankHeads.to_dict`)
    out/tp{N}/rank{r}/attention.safetensors               the folded projections of those heads, per layer i
                                                          (names from the family table's ``FoldSpec``):
        model.layers.{i}.self_attn.v_proj.weight  [H_kv/N * D, hidden]   rows of the folded v_proj (D rows: replicated)
        model.layers.{i}.self_attn.v_proj.bias    [H_kv/N * D]           where v_proj has a bias
        model.layers.{i}.self_attn.o_proj.weight  [hidden, H/N * D]      input columns of the folded o_proj

The slices are cut from the folded full weights (``export.fold_value_transforms``, the one fold). The fold is
block-diagonal per KV head (rows of head h in ``v_proj`` and columns of its query heads in ``o_proj`` see only
``R_V[h]``, ``d_V[h]``), so this equals folding each rank's slice with that rank's transforms.
``tests/oscar_export/test_tensor_parallel.py`` checks it on the attention output: the ranks' partial ``o_proj``
outputs, each computed from its own slices and artifact, sum to the unsharded model's attention output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from oscar_export.calibration.artifact import OscarArtifact, load_artifact
from oscar_export.calibration.artifact_format import LIMITS, TENSOR_FIELDS, ArtifactError
from oscar_export.calibration.families import FoldSpec
from oscar_export.calibration.safe_json import printable
from oscar_export.checkpoint import artifact_path, checkpoint_tensors, read_config_json, read_export

#: the projections of one rank, beside its artifact in ``tp{N}/rank{r}/``.
RANK_TENSORS = "attention.safetensors"


@dataclass(frozen=True)
class RankHeads:
    """The heads rank ``rank`` of ``size`` owns: ``kv_heads`` and the ``query_heads`` that read them; each KV head
    is on ``replicas`` ranks (1 unless ``size > H_kv``)."""

    rank: int
    size: int
    kv_heads: range
    query_heads: range
    replicas: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The fingerprint's ``"tensor_parallel"`` entry (head ranges as ``[start, stop)``)."""
        return {"size": self.size, "rank": self.rank, "kv_heads": [self.kv_heads.start, self.kv_heads.stop],
                "query_heads": [self.query_heads.start, self.query_heads.stop], "kv_replicas": self.replicas}

    @classmethod
    def of_fingerprint(cls, fp: dict[str, Any], where: str) -> "RankHeads":
        """The entry of a rank artifact's (untrusted) fingerprint, checked against its per-rank head counts."""
        entry = fp.get("tensor_parallel")
        get = entry.get if isinstance(entry, dict) else lambda k: None
        size, rank, rep = get("size"), get("rank"), get("kv_replicas")
        if (any(type(x) is not int for x in (size, rank, rep)) or not 0 <= rank < size <= LIMITS.max_heads
                or not 1 <= rep <= size or size % rep):
            raise ArtifactError(f"{where}: fingerprint.tensor_parallel: expected {{size, rank, kv_heads, query_heads, "
                                f"kv_replicas}} with 0 <= rank < size, got {printable(repr(entry), 120)}")
        full_kv = size * fp["num_key_value_heads"] // rep
        try:
            heads = rank_heads(size * fp["num_attention_heads"], full_kv, size)[rank]
        except ValueError as e:
            raise ArtifactError(f"{where}: fingerprint.tensor_parallel: {e}") from None
        if entry != heads.to_dict():
            raise ArtifactError(f"{where}: fingerprint.tensor_parallel: expected {heads.to_dict()} for "
                                f"{fp['num_key_value_heads']} KV heads per rank, got {printable(repr(entry), 160)}")
        return heads


def rank_heads(num_heads: int, num_kv_heads: int, tp: int) -> list[RankHeads]:
    """The heads of every rank for tensor parallelism of size ``tp`` (counts from the family table).

    Raises:
        ValueError: ``tp`` is not a positive int, or neither divides ``num_kv_heads`` nor is a multiple of it
            that divides ``num_heads`` (TensorRT-LLM's rule: KV heads are split, or replicated when tp > H_kv).
    """
    if type(tp) is not int or tp < 1:
        raise ValueError(f"tensor parallelism: expected a tp size >= 1, got {tp!r}")
    if num_kv_heads % tp == 0:
        kv, q = num_kv_heads // tp, num_heads // tp
        return [RankHeads(r, tp, range(r * kv, (r + 1) * kv), range(r * q, (r + 1) * q)) for r in range(tp)]
    if tp % num_kv_heads == 0 and num_heads % tp == 0:
        rep, q = tp // num_kv_heads, num_heads // tp  # KV head r // rep on ranks rep*h .. rep*h + rep - 1
        return [RankHeads(r, tp, range(r // rep, r // rep + 1), range(r * q, (r + 1) * q), rep) for r in range(tp)]
    fits = [n for n in range(1, num_heads + 1) if num_kv_heads % n == 0 or n % num_kv_heads == 0 and num_heads % n == 0]
    raise ValueError(
        f"tensor parallelism: tp {tp} does not fit the model's {num_kv_heads} KV heads (H_kv) and {num_heads} query "
        f"heads: tp must divide H_kv, or (TensorRT-LLM replicates KV heads when tp > H_kv) be a multiple of H_kv "
        f"that divides the query heads; use tp in {fits}"
    )


def rank_dir(root: str | Path, heads: RankHeads) -> Path:
    """``root/tp{N}/rank{r}``."""
    return Path(root) / f"tp{heads.size}" / f"rank{heads.rank}"


# ---- the shares -------------------------------------------------------------------------------------------------


def shard_artifact(artifact: OscarArtifact, heads: RankHeads) -> OscarArtifact:
    """Rank ``heads``' artifact: every per-head tensor sliced, the per-rank head counts in its fingerprint."""
    fp = artifact.fingerprint
    if heads not in rank_heads(fp["num_attention_heads"], fp["num_key_value_heads"], heads.size):
        raise ValueError(f"shard_artifact: {heads.to_dict()} is not a rank of this artifact's "
                         f"{fp['num_attention_heads']} query / {fp['num_key_value_heads']} KV heads")
    kv = slice(heads.kv_heads.start, heads.kv_heads.stop)
    transforms = [replace(t, **{f: getattr(t, f)[kv].clone() for f in TENSOR_FIELDS}) for t in artifact.transforms]
    fingerprint = {**fp, "num_attention_heads": len(heads.query_heads), "num_key_value_heads": len(heads.kv_heads),
                   "tensor_parallel": heads.to_dict()}
    layout = replace(artifact.layout, num_kv_heads=len(heads.kv_heads))
    return OscarArtifact(layout, tuple(transforms), fingerprint, dict(artifact.config), {})


def projection_names(fold: FoldSpec, layer: int) -> dict[str, str]:
    """``{"v_weight", "v_bias", "o_weight"}`` -> the state-dict name of layer ``layer``'s tensor."""
    p = f"{fold.layers}.{layer}.{fold.attention}."
    return {"v_weight": f"{p}{fold.v_proj}.weight", "v_bias": f"{p}{fold.v_proj}.bias",
            "o_weight": f"{p}{fold.o_proj}.weight"}


def shard_projections(
    state: Mapping[str, torch.Tensor], fold: FoldSpec, num_layers: int, head_dim: int, heads: RankHeads
) -> dict[str, torch.Tensor]:
    """Rank ``heads``' rows of every folded ``v_proj`` (and bias) and input columns of every folded ``o_proj``.

    Args:
        state: the folded model's tensors by state-dict name (``v_proj.weight [H_kv * D, hidden]``,
            ``o_proj.weight [hidden, H * D]``).
    """
    rows = slice(heads.kv_heads.start * head_dim, heads.kv_heads.stop * head_dim)
    cols = slice(heads.query_heads.start * head_dim, heads.query_heads.stop * head_dim)
    out = {}
    for i in range(num_layers):
        n = projection_names(fold, i)
        out[n["v_weight"]] = state[n["v_weight"]][rows].clone()  # [H_kv/N * D, hidden]
        if n["v_bias"] in state:
            out[n["v_bias"]] = state[n["v_bias"]][rows].clone()  # [H_kv/N * D]
        out[n["o_weight"]] = state[n["o_weight"]][:, cols].contiguous()  # [hidden, H/N * D]
    return out


# ---- files ------------------------------------------------------------------------------------------------------


def write_ranks(
    state: Mapping[str, torch.Tensor], artifact: OscarArtifact, fold: FoldSpec, root: str | Path, tp: int
) -> list[Path]:
    """Write ``root/tp{tp}/rank{r}/`` for every rank (see the module doc); returns the rank directories.

    Args:
        state: the folded (and cast) model's tensors, as the checkpoint holds them.
        artifact: the artifact of the folded model (``values_prerotated``).
    """
    from safetensors.torch import save_file

    fp = artifact.fingerprint
    dirs = []
    for heads in rank_heads(fp["num_attention_heads"], fp["num_key_value_heads"], tp):
        d = rank_dir(root, heads)
        shard_artifact(artifact, heads).save(d)
        tensors = shard_projections(state, fold, artifact.num_layers, artifact.layout.head_dim, heads)
        save_file(tensors, str(d / RANK_TENSORS), metadata={"tp_size": str(tp), "tp_rank": str(heads.rank)})
        dirs.append(d)
    return dirs


def load_rank(directory: str | Path) -> tuple[OscarArtifact, RankHeads, dict[str, torch.Tensor]]:
    """``(artifact, heads, projections)`` of one rank directory, the artifact validated by ``load_artifact``."""
    from safetensors.torch import load_file

    d = Path(directory)
    art = load_artifact(d)
    if "tensor_parallel" not in art.fingerprint:
        raise ArtifactError(f"{printable(d)}: not a tensor-parallel rank (its fingerprint has no 'tensor_parallel')")
    heads = RankHeads.of_fingerprint(art.fingerprint, printable(d))
    path = d / RANK_TENSORS
    if not path.is_file():
        raise FileNotFoundError(f"{printable(path)} is missing")
    return art, heads, load_file(str(path))


def check_ranks(
    state: Mapping[str, torch.Tensor], artifact: OscarArtifact, fold: FoldSpec, root: str | Path, tp: int
) -> int:
    """Check that the ranks under ``root/tp{tp}/`` put together give the unsharded export, tensor for tensor.

    The KV-head tensors (artifact fields, ``v_proj`` rows and bias) of the first replica of every KV head
    concatenate to the unsharded ones, and every other replica equals its first; the ``o_proj`` columns of all
    ranks concatenate to the unsharded ``o_proj``.

    Args:
        state: the unsharded checkpoint's tensors (at least every ``v_proj``/``o_proj``).
        artifact: the unsharded checkpoint's artifact.
    Returns:
        the number of tensors compared (all ``torch.equal``).
    Raises:
        ValueError: naming the first tensor that differs (or a rank whose heads are not the expected ones).
    """
    fp = artifact.fingerprint
    heads = rank_heads(fp["num_attention_heads"], fp["num_key_value_heads"], tp)
    loaded = [load_rank(rank_dir(root, h)) for h in heads]
    for h, (_, got, _) in zip(heads, loaded):
        if got != h:
            raise ValueError(f"{printable(rank_dir(root, h))}: expected the heads {h.to_dict()}, got {got.to_dict()}")
    rep = heads[0].replicas  # rank r's KV heads are first held by rank r - r % rep

    def kv_tensors(art: OscarArtifact, proj: Mapping[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        names = projection_names(fold, i)
        out = {f"layers.{i}.{f}": getattr(art.transforms[i], f) for f in TENSOR_FIELDS}
        out.update({names[k]: proj[names[k]] for k in ("v_weight", "v_bias") if names[k] in proj})
        return out

    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for i, t in enumerate(artifact.transforms):
        names = projection_names(fold, i)
        full = {f"layers.{i}.{f}": getattr(t, f) for f in TENSOR_FIELDS}
        full.update({names[k]: state[names[k]] for k in ("v_weight", "v_bias") if names[k] in state})
        per_rank = [kv_tensors(art, proj, i) for art, _, proj in loaded]
        firsts = per_rank[::rep]
        for name, x in full.items():
            pairs.append((name, x, torch.cat([p[name] for p in firsts])))
        for r in range(tp):
            if r % rep:
                ref = per_rank[r - r % rep]
                pairs.extend((f"rank {r} replica of {name}", ref[name], per_rank[r][name]) for name in ref)
        o = names["o_weight"]
        pairs.append((o, state[o], torch.cat([proj[o] for _, _, proj in loaded], dim=1)))
    for name, full_t, cat in pairs:
        if full_t.shape != cat.shape or full_t.dtype != cat.dtype or not torch.equal(full_t, cat):
            worst = (full_t.double() - cat.double()).abs().max().item() if full_t.shape == cat.shape else float("nan")
            raise ValueError(f"tp {tp}: {name}: the ranks give {list(cat.shape)} {cat.dtype}, the unsharded "
                             f"export has {list(full_t.shape)} {full_t.dtype} (max |difference| {worst:.3g})")
    return len(pairs)


def check_tp_export(ckpt: str | Path, tp: int) -> int:
    """Check that ``ckpt/tp{tp}/rank*/`` concatenate to the unsharded export (:func:`check_ranks`); returns the
    number of tensors compared."""
    from oscar_export.calibration.families import family_for_config_dict

    section = read_export(ckpt)
    config = read_config_json(ckpt)
    fold = family_for_config_dict({k: v for k, v in config.items() if k != "oscar"}).family.fold
    artifact = load_artifact(artifact_path(ckpt, section))
    names = {n for i in range(artifact.num_layers) for n in projection_names(fold, i).values()}
    return check_ranks(checkpoint_tensors(ckpt, names), artifact, fold, ckpt, tp)


__all__ = ["RANK_TENSORS", "RankHeads", "check_ranks", "check_tp_export", "load_rank", "projection_names", "rank_dir",
           "rank_heads", "shard_artifact", "shard_projections", "write_ranks"]
