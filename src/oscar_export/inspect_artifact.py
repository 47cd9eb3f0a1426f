"""Show an OSCAR artifact: fingerprint, cache layout, bits per element, calibration config and per-layer fits.

The artifact is fully validated first (the same checks every consumer runs), so a clean ``inspect`` also
means the artifact loads. Strings from the artifact are printed with control characters escaped (an
artifact from a stranger cannot send terminal escape sequences), and calibration stats of unexpected types
are shown as absent.
"""

from __future__ import annotations

import argparse
import json

EPILOG = """examples:
  oscar-export inspect artifacts/smollm2
  oscar-export inspect artifacts/smollm2 --json > summary.json
"""

LENGTHS = (1024, 4096, 8192, 32768)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="artifact directory (oscar.json + rotations.safetensors)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--layers", action="store_true", help="print the per-layer table (default: summary only)")


def _number(x):
    """``x`` if it is a JSON number (not a bool), else None: calibration stats are read, never trusted."""
    return x if type(x) in (int, float) else None


def _side_stats(layer_stats, side: str) -> dict:
    """The typed parts of one side's calibration stats (rotation names, held-out ratios); None where absent."""
    from oscar_export.calibration.safe_json import printable

    s = layer_stats.get(side) if isinstance(layer_stats, dict) else None
    s = s if isinstance(s, dict) else {}
    rot = s.get("rotation")
    rot = [printable(r, 24) for r in rot if isinstance(r, str)] if isinstance(rot, list) else None
    return {"rotation": rot or None, "vs_identity": _number(s.get("vs_identity")),
            "vs_hadamard": _number(s.get("vs_hadamard"))}


def summarize(art) -> dict:
    """A JSON-ready description of ``art`` (an :class:`OscarArtifact`)."""
    from oscar_export.calibration.rotation import orthogonality_error

    lay = art.layout
    ortho = max(max(orthogonality_error(t.k_rotation), orthogonality_error(t.v_rotation)) for t in art.transforms)
    per_layer = art.stats.get("layers")
    if not isinstance(per_layer, list) or len(per_layer) != art.num_layers:
        per_layer = [None] * art.num_layers
    layers = []
    for i, t in enumerate(art.transforms):
        row = {"layer": i}
        for side in "kv":
            row[side] = {
                "clip": [round(x, 4) for x in getattr(t, f"{side}_clip").tolist()],
                "scaled": bool((getattr(t, f"{side}_scale") != 1).any()),
                "mean": bool((getattr(t, f"{side}_mean") != 0).any()),
                "levels": [[round(x, 3) for x in lv] for lv in getattr(t, f"{side}_levels").tolist()],
                **_side_stats(per_layer[i], side),
            }
        layers.append(row)
    return {
        "fingerprint": art.fingerprint,
        "layout": lay.to_dict(),
        "key_bits": list(art.key_bits),
        "bits_per_element": {"int2": round(art.bits_per_element(), 4),
                             **{str(n): round(art.bits_per_element(n), 4) for n in LENGTHS}},
        "values_prerotated": art.transforms[0].values_prerotated,
        "max_orthogonality_error_fp32": ortho,
        "config": art.config,
        "stats": {k: v for k, v in art.stats.items() if k != "layers"},
        "layers": layers,
    }


def _text(x, limit: int = 120) -> str:
    """A JSON value from the artifact as one terminal-safe string (strings as they are, the rest as JSON)."""
    from oscar_export.calibration.safe_json import printable

    return printable(x if isinstance(x, str) else json.dumps(x, sort_keys=True), limit)


def _fmt_side(s: dict) -> str:
    rot = ",".join(sorted(set(s["rotation"] or ["?"])))
    vi = f"{s['vs_identity']:.3f}" if s["vs_identity"] is not None else "-"
    vh = f"{s['vs_hadamard']:.3f}" if s["vs_hadamard"] is not None else "-"
    clip = "/".join(f"{c:.2f}" for c in s["clip"])
    extras = ("d" if s["scaled"] else "") + ("m" if s["mean"] else "")
    return f"{rot[:16]:>16} {clip:>14} {extras:>2} {vi:>6} {vh:>6}"


def run(args: argparse.Namespace) -> int:
    from oscar_export.calibration.artifact import load_artifact

    art = load_artifact(args.artifact)
    info = summarize(art)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    fp, lay = info["fingerprint"], art.layout
    print(f"artifact   {_text(args.artifact, 400)}")
    print(f"model      {_text(fp.get('name') or '?', 80)} {_text(fp['model_type'], 40)}: {fp['num_hidden_layers']} "
          f"layers, {fp['num_attention_heads']} query / {fp['num_key_value_heads']} KV heads, head_dim "
          f"{fp['head_dim']}, rope {_text(fp['rope'], 200)}")
    if "tensor_parallel" in fp:  # a rank of `oscar-export export --tp N` (oscar_export/tensor_parallel.py)
        print(f"tp rank    {_text(fp['tensor_parallel'], 200)}")
    print(f"layout     keys {lay.key.granularity} (G={lay.key.group_size}, codebook {lay.key.codebook}), values "
          f"{lay.value.granularity} (G={lay.value.group_size}, codebook {lay.value.codebook}); sink {lay.sink}, "
          f"window {lay.window}, page {lay.page_size}")
    wide = [i for i, b in enumerate(art.key_bits) if b != lay.key.bits]
    if wide:
        print(f"key bits   {lay.key.bits}-bit keys except {len(wide)} of {art.num_layers} layers at "
              f"{sorted({art.key_bits[i] for i in wide})} bits: layers {wide}")
    bits = info["bits_per_element"]
    print("bits/elem  INT2 part {:.3f}; whole sequence ".format(bits["int2"])
          + ", ".join(f"{n} tok {bits[str(n)]:.3f}" for n in LENGTHS))
    print(f"rotations  max |R^T R - I| = {info['max_orthogonality_error_fp32']:.2e} (fp32 storage)"
          f"{'; values pre-rotated (exported checkpoint)' if info['values_prerotated'] else ''}")
    print("config     " + ", ".join(f"{_text(k, 40)}={_text(v)}" for k, v in art.config.items()))
    print("stats      " + ", ".join(f"{_text(k, 40)}={_text(v)}" for k, v in info["stats"].items()))
    rows = info["layers"]
    for side in "kv":
        vi = [r[side]["vs_identity"] for r in rows if r[side]["vs_identity"] is not None]
        vh = [r[side]["vs_hadamard"] for r in rows if r[side]["vs_hadamard"] is not None]
        if vi:
            print(f"{side.upper()} error    mean held-out ratio vs identity {sum(vi) / len(vi):.3f}, "
                  f"vs Hadamard+global clip {sum(vh) / len(vh):.3f}")
    if args.layers:
        print(f"{'layer':>5} | {'K rotation':>16} {'K clip':>14} {'':>2} {'K/id':>6} {'K/had':>6} | "
              f"{'V rotation':>16} {'V clip':>14} {'':>2} {'V/id':>6} {'V/had':>6}")
        for r in rows:
            wide_k = f" K{art.key_bits[r['layer']]}" if art.key_bits[r["layer"]] != lay.key.bits else ""
            print(f"{r['layer']:5d} | {_fmt_side(r['k'])} | {_fmt_side(r['v'])}{wide_k}")
    return 0
