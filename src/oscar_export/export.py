"""Fold the OSCAR value transform into v_proj/o_proj and write a Hugging Face checkpoint with the artifact.

Per KV head ``h`` with ``M_h = R_V[h] @ diag(d_V[h])`` (``LayerTransform``; docs/design.md §3.4, §4):

    v_proj rows of head h:      W_h <- M_h^T W_h          b_h <- b_h M_h            (model emits v @ M_h)
    o_proj columns of query j:  Wo_j <- Wo_j R_V[h] diag(1 / d_V[h])  for every query head j reading h

so attention over the exported values, followed by the exported ``o_proj``, equals the original model
(attention is linear in the values). Computed in float64, stored in the checkpoint dtype. The key
rotation cannot be folded (RoPE sits between ``k_proj`` and the cache), and means, clips and codebooks
act on stored rows: they stay in the artifact, saved inside the checkpoint with ``values_prerotated=True``.

Output (written to a temp dir next to ``--out`` and renamed at the end by ``oscar_export.atomic_dir``, so a
failure, Ctrl-C or SIGTERM leaves nothing that looks complete)::

    out/config.json          the model config plus an "oscar" section (``checkpoint.py``: the checkpoint's schema)
    out/model.safetensors    folded weights
    out/tokenizer*           the tokenizer
    out/oscar_artifact/      the artifact (oscar.json, rotations.safetensors), values_prerotated=True
    out/tp{N}/rank{r}/       with --tp N: rank r's artifact and v_proj/o_proj slices (``oscar_export.tensor_parallel``)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from oscar_export.calibration.families import family_for, family_for_pretrained
from oscar_export.checkpoint import ARTIFACT_DIR, write_checkpoint

EPILOG = """example:
  oscar-export calibrate --model default --out art/
  oscar-export export --model default --artifact art/ --out ckpt/
  oscar-export export --model ./my-llama --artifact art/ --out ckpt/ --tp 2   # also ckpt/tp2/rank{0,1}/
  python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('ckpt/')"
"""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- folding ---------------------------------------------------------------------------------------------------


def attention_modules(model) -> list[Any]:
    """The attention module of every decoder layer, where the family table says it is.

    Raises:
        NotImplementedError: the table's error for an architecture or feature the cache cannot serve, or a
            model whose modules are not where its family puts them.
    """
    fold = family_for(model).family.fold
    layers: Any = model
    for part in fold.layers.split("."):
        layers = getattr(layers, part, None)
    if layers is None:
        raise NotImplementedError(f"export: {type(model).__name__} has no .{fold.layers} (expected by its family)")
    attns = [getattr(layer, fold.attention, None) for layer in layers]
    for i, a in enumerate(attns):
        if not (hasattr(a, fold.v_proj) and hasattr(a, fold.o_proj)):
            raise NotImplementedError(
                f"export: layer {i}: expected .{fold.attention}.{fold.v_proj} and .{fold.o_proj}, "
                f"got {type(a).__name__}"
            )
    return attns


@torch.no_grad()
def fold_value_transforms(model, transforms: Sequence[Any]) -> None:
    """Fold every layer's ``R_V``/``d_V`` into ``v_proj``/``o_proj`` in place (see the module doc).

    Args:
        model: a HF causal LM of a supported architecture.
        transforms: one ``LayerTransform`` per layer (``v_rotation [H_kv, D, D]``, ``v_scale [H_kv, D]``),
            not yet ``values_prerotated``.
    """
    attns = attention_modules(model)
    facts = family_for(model)
    fold = facts.family.fold
    h, hkv, d, group = facts.num_heads, facts.num_kv_heads, facts.head_dim, facts.group_size
    if len(transforms) != len(attns):
        raise ValueError(f"export: artifact has {len(transforms)} layers, model has {len(attns)}")
    projections = []
    for i, (attn, t) in enumerate(zip(attns, transforms)):  # every check before the first write
        if t.values_prerotated:
            raise ValueError(f"export: layer {i} transform is already values_prerotated (exporting twice?)")
        if (t.num_kv_heads, t.head_dim) != (hkv, d):
            raise ValueError(
                f"export: layer {i}: artifact has {t.num_kv_heads} KV heads x head_dim {t.head_dim}, "
                f"model has {hkv} x {d}"
            )
        v_proj, o_proj = getattr(attn, fold.v_proj), getattr(attn, fold.o_proj)
        if v_proj.weight.shape[0] != hkv * d or o_proj.weight.shape[1] != h * d:
            raise ValueError(
                f"export: layer {i}: expected {fold.v_proj} [{hkv * d}, hidden] and {fold.o_proj} "
                f"[hidden, {h * d}], got {list(v_proj.weight.shape)} and {list(o_proj.weight.shape)}"
            )
        projections.append((v_proj, o_proj))
    for (v_proj, o_proj), t in zip(projections, transforms):
        r = t.v_rotation.double().to(v_proj.weight.device)  # [H_kv, D, D]
        s = t.v_scale.double().to(r.device)  # [H_kv, D]
        m = r * s[:, None, :]  # R diag(d): [H_kv, D, D]
        m_inv_t = r / s[:, None, :]  # (diag(1/d) R^T)^T = R diag(1/d)

        wv = v_proj.weight  # [H_kv * D, hidden]
        wv64 = wv.double().view(hkv, d, -1)
        wv.copy_(torch.matmul(m.transpose(-1, -2), wv64).reshape(wv.shape).to(wv.dtype))
        if v_proj.bias is not None:
            bv = v_proj.bias  # [H_kv * D]
            bv.copy_(torch.matmul(bv.double().view(hkv, 1, d), m).reshape(bv.shape).to(bv.dtype))

        wo = o_proj.weight  # [hidden, H * D], head-major: query head j = KV head j // g (FoldSpec.o_proj_layout)
        wo64 = wo.double().view(-1, hkv, group, d).permute(1, 2, 0, 3)  # [H_kv, g, hidden, D]
        folded = torch.matmul(wo64, m_inv_t[:, None])  # [H_kv, g, hidden, D]
        wo.copy_(folded.permute(2, 0, 1, 3).reshape(wo.shape).to(wo.dtype))


# ---- the transaction -----------------------------------------------------------------------------------------


def export_checkpoint(
    model, tokenizer, artifact, out: str | Path, source: str = "", dtype: torch.dtype | None = None,
    force: bool = False, tp: int | None = None, inputs=(),
) -> Path:
    """Fold ``artifact`` into ``model`` (in place) and write the checkpoint directory ``out`` atomically.

    ``out`` must be absent or empty; with ``force`` an earlier checkpoint (a directory with a ``config.json``)
    is replaced: moved aside, the new one renamed in, the old one removed (``oscar_export.atomic_dir``).
    With ``tp`` the per-rank view ``out/tp{tp}/rank{r}/`` is written in the same transaction
    (``tensor_parallel.write_ranks``; a ``tp`` that does not fit the heads is refused before folding).
    ``inputs``: ``(option, path)`` pairs ``out`` must stay apart from (``out_dir.check_inputs``).
    """
    from oscar_export.atomic_dir import atomic_dir
    from oscar_export.out_dir import check_out_dir
    from oscar_export.tensor_parallel import rank_heads, write_ranks

    if getattr(model.config, "oscar", None):
        raise ValueError("export: this model is already an OSCAR export (its config has an 'oscar' section)")
    artifact.check_model(model.config)
    inputs = list(inputs)
    check_out_dir(out, force, looks_like="config.json", inputs=inputs)
    facts = family_for(model)
    if tp is not None:
        rank_heads(facts.num_heads, facts.num_kv_heads, tp)  # refused before anything is folded
    fold_value_transforms(model, artifact.transforms)
    if dtype is not None:
        model.to(dtype)
    with atomic_dir(out, force=force, looks_like="config.json", inputs=inputs) as tmp:
        write_checkpoint(tmp, model, tokenizer, artifact, source)
        if tp is not None:
            write_ranks(model.state_dict(), artifact.with_values_prerotated(True), facts.family.fold, tmp, tp)
    return Path(out)


# ---- command line ---------------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2) or a local HF model directory")
    p.add_argument("--artifact", required=True, help="OSCAR artifact directory from `oscar-export calibrate`")
    p.add_argument("--out", required=True, help="new checkpoint directory (absent or empty; see --force)")
    p.add_argument("--force", action="store_true", help="replace an earlier checkpoint at --out (atomically)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the written weights")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="also write the tensor-parallel view out/tpN/rank{0..N-1}/ (N divides the KV heads, or is "
                        "a multiple of them: KV heads replicated, as TensorRT-LLM does)")


def run(args) -> int:
    from oscar_export.calibration.artifact import load_artifact
    from oscar_export.models import load_model
    from oscar_export.out_dir import check_out_dir
    from oscar_export.tensor_parallel import check_tp_export, rank_heads

    inputs = [("--model", None if args.model == "default" else args.model), ("--artifact", args.artifact)]
    check_out_dir(args.out, args.force, looks_like="config.json", inputs=inputs, claim=True)  # before the model loads
    if not Path(args.artifact).is_dir():
        raise FileNotFoundError(f"--artifact {args.artifact}: no such directory")
    if (Path(args.model) / "config.json").is_file():
        family_for_pretrained(args.model)  # refuse what serving cannot run before loading any weights
    artifact = load_artifact(args.artifact)
    if args.tp is not None:  # the artifact's head counts (the family table's, at calibration) before the load
        rank_heads(artifact.fingerprint["num_attention_heads"], artifact.fingerprint["num_key_value_heads"], args.tp)
    model, tok = load_model(args.model, dtype=torch.float32)
    out = export_checkpoint(model, tok, artifact, args.out, source=args.model, dtype=DTYPES[args.dtype],
                            force=args.force, tp=args.tp, inputs=inputs)
    print(f"wrote {out} ({len(artifact.transforms)} layers folded, artifact in {out / ARTIFACT_DIR})")
    if args.tp is not None:
        n = check_tp_export(out, args.tp)
        print(f"wrote {out / f'tp{args.tp}'}: {args.tp} ranks; their {n} tensors concatenate to the unsharded export")
    return 0


__all__ = ["attention_modules", "export_checkpoint", "fold_value_transforms"]
