"""Tensor-parallel export: each rank's share of an exported checkpoint, as TensorRT-LLM's tensor parallelism splits it.

With tensor parallelism of size N, rank r owns the KV heads ``[r*H_kv/N, (r+1)*H_kv/N)`` and the query heads
that read them, ``[r*H/N, (r+1)*H/N)`` (query head ``j`` reads KV head ``j // g``, ``g = H / H_kv``, so the two
ranges line up). ``v_proj`` is column-parallel (a rank holds the output rows of its KV heads), ``o_proj`` is
row-parallel (a rank holds the input columns of its query heads; the ranks' partial outputs are summed by the
all-reduce, and ``o_proj``'s bias, if any, is added once after it: it is not part of a rank's share).

``oscar-export export --tp N`` writes, beside the normal checkpoint::

    out/tp{N}/rank{r}/oscar.json, rotations.safetensors   the artifact of rank r's KV heads (rotations, scalings,
                                                          means, clips, levels; values_prerotated), read by
                                                          ``calibration.artifact.load_artifact``; its fingerprint
                                                          has the per-rank head counts H/N and H_kv/N and a
                                                          ``"tensor_parallel"`` entry (size, rank, head ranges)
    out/tp{N}/rank{r}/attention.safetensors               the folded projections of those heads, per layer i
                                                          (names from the family table's ``FoldSpec``):
        model.layers.{i}.self_attn.v_proj.weight  [H_kv/N * D, hidden]   rows of the folded v_proj
        model.layers.{i}.self_attn.v_proj.bias    [H_kv/N * D]           where v_proj has a bias
        model.layers.{i}.self_attn.o_proj.weight  [hidden, H/N * D]      input columns of the folded o_proj

The slices are cut from the folded full weights (``export.fold_value_transforms``, the one fold). The fold is
block-diagonal per KV head (rows of head h in ``v_proj`` and columns of its query heads in ``o_proj`` see only
``R_V[h]``, ``d_V[h]``), so this equals folding each rank's slice with that rank's transforms.
``tests/oscar_export/test_tensor_parallel.py`` checks it on the attention output: the ranks' partial ``o_proj``
outputs, each computed from its own slices and artifact, sum to the unsharded model's attention output.

KV heads that N does not divide are refused (:func:`rank_heads`). TensorRT-LLM replicates KV heads when
``tp > H_kv`` (each KV head copied to ``tp / H_kv`` ranks); this export writes disjoint KV-head shards only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from oscar_export.calibration.artifact import (
    LIMITS, TENSOR_FIELDS, ArtifactError, OscarArtifact, load_artifact, printable,
)
from oscar_export.calibration.families import FoldSpec

#: the projections of one rank, beside its artifact in ``tp{N}/rank{r}/``.
RANK_TENSORS = "attention.safetensors"


@dataclass(frozen=True)
class RankHeads:
    """The heads rank ``rank`` of ``size`` owns: ``kv_heads`` and the ``query_heads`` that read them."""

    rank: int
    size: int
    kv_heads: range
    query_heads: range

    def to_dict(self) -> dict[str, Any]:
        """The fingerprint's ``"tensor_parallel"`` entry (head ranges as ``[start, stop)``)."""
        return {"size": self.size, "rank": self.rank, "kv_heads": [self.kv_heads.start, self.kv_heads.stop],
                "query_heads": [self.query_heads.start, self.query_heads.stop]}

    @classmethod
    def of_fingerprint(cls, fp: dict[str, Any], where: str) -> "RankHeads":
        """The entry of a rank artifact's (untrusted) fingerprint, checked against its per-rank head counts."""
        entry = fp.get("tensor_parallel")
        size = entry.get("size") if isinstance(entry, dict) else None
        rank = entry.get("rank") if isinstance(entry, dict) else None
        if type(size) is not int or type(rank) is not int or not 0 <= rank < size <= LIMITS.max_kv_heads:
            raise ArtifactError(f"{where}: fingerprint.tensor_parallel: expected {{size, rank, kv_heads, query_heads}} "
                                f"with 0 <= rank < size, got {printable(repr(entry), 120)}")
        heads = rank_heads(size * fp["num_attention_heads"], size * fp["num_key_value_heads"], size)[rank]
        if entry != heads.to_dict():
            raise ArtifactError(f"{where}: fingerprint.tensor_parallel: expected {heads.to_dict()} for "
                                f"{fp['num_key_value_heads']} KV heads per rank, got {printable(repr(entry), 160)}")
        return heads


def rank_heads(num_heads: int, num_kv_heads: int, tp: int) -> list[RankHeads]:
    """The heads of every rank for tensor parallelism of size ``tp`` (counts from the family table).

    Raises:
        ValueError: ``tp`` is not a positive int, or does not divide ``num_kv_heads``. TensorRT-LLM replicates
            KV heads when ``tp > H_kv``; this export does not write replicated shards.
    """
    if type(tp) is not int or tp < 1:
        raise ValueError(f"tensor parallelism: expected a tp size >= 1, got {tp!r}")
    if num_kv_heads % tp:
        fits = [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0]
        raise ValueError(
            f"tensor parallelism: tp {tp} does not divide the model's {num_kv_heads} KV heads (H_kv); a rank must "
            f"own whole KV heads: use tp in {fits}. (TensorRT-LLM replicates KV heads when tp > H_kv; this export "
            f"does not write replicated shards.)"
        )
    kv, q = num_kv_heads // tp, num_heads // tp
    return [RankHeads(r, tp, range(r * kv, (r + 1) * kv), range(r * q, (r + 1) * q)) for r in range(tp)]


def rank_dir(root: str | Path, heads: RankHeads) -> Path:
    """``root/tp{N}/rank{r}``."""
    return Path(root) / f"tp{heads.size}" / f"rank{heads.rank}"


# ---- the shares -------------------------------------------------------------------------------------------------


def shard_artifact(artifact: OscarArtifact, heads: RankHeads) -> OscarArtifact:
    """Rank ``heads``' artifact: every per-head tensor sliced, the per-rank head counts in its fingerprint."""
    fp = artifact.fingerprint
    if (fp["num_attention_heads"], fp["num_key_value_heads"]) != (
        heads.size * len(heads.query_heads), heads.size * len(heads.kv_heads)
    ):
        raise ValueError(f"shard_artifact: the artifact has {fp['num_attention_heads']} query / "
                         f"{fp['num_key_value_heads']} KV heads, the ranks were cut for "
                         f"{heads.size * len(heads.query_heads)} / {heads.size * len(heads.kv_heads)}")
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
    """Check that the ranks under ``root/tp{tp}/`` concatenate to the unsharded export, tensor for tensor.

    Args:
        state: the unsharded checkpoint's tensors (at least every ``v_proj``/``o_proj``).
        artifact: the unsharded checkpoint's artifact.
    Returns:
        the number of tensors compared (all ``torch.equal``).
    Raises:
        ValueError: naming the first tensor that differs (or a rank's head ranges that are not the expected ones).
    """
    fp = artifact.fingerprint
    heads = rank_heads(fp["num_attention_heads"], fp["num_key_value_heads"], tp)
    loaded = [load_rank(rank_dir(root, h)) for h in heads]
    for h, (_, got, _) in zip(heads, loaded):
        if got != h:
            raise ValueError(f"{printable(rank_dir(root, h))}: expected the heads {h.to_dict()}, got {got.to_dict()}")
    ranks = [(art, tensors) for art, _, tensors in loaded]
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for i, t in enumerate(artifact.transforms):
        for f in TENSOR_FIELDS:
            pairs.append((f"layers.{i}.{f}", getattr(t, f), torch.cat([getattr(a.transforms[i], f) for a, _ in ranks])))
        n = projection_names(fold, i)
        for key, dim in (("v_weight", 0), ("v_bias", 0), ("o_weight", 1)):
            if key == "v_bias" and n[key] not in state:
                continue
            pairs.append((n[key], state[n[key]], torch.cat([p[n[key]] for _, p in ranks], dim=dim)))
    for name, full, cat in pairs:
        if full.shape != cat.shape or full.dtype != cat.dtype or not torch.equal(full, cat):
            worst = (full.double() - cat.double()).abs().max().item() if full.shape == cat.shape else float("nan")
            raise ValueError(f"tp {tp}: {name}: the ranks concatenate to {list(cat.shape)} {cat.dtype}, the unsharded "
                             f"export has {list(full.shape)} {full.dtype} (max |difference| {worst:.3g})")
    return len(pairs)


__all__ = ["RANK_TENSORS", "RankHeads", "check_ranks", "load_rank", "projection_names", "rank_dir", "rank_heads",
           "shard_artifact", "shard_projections", "write_ranks"]
