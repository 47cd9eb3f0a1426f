"""Recipe choices on the dev split: several of our caches scored against BF16 on the same dev windows in one process
(the model loaded and BF16's hidden states computed once per window), fake-quantized decode-as-deployed exactly as
``oscar-export eval --split dev`` scores them (``text.final_hidden``, ``text.score_methods``):

    python benchmarks/dev_split.py ART[@BUDGET[h]] ... --lengths 2048,4096 --windows 4 --json out.json

Each argument is one cache built from a calibrated artifact folder ``ART``:

* ``ART``: the artifact as calibrated;
* ``ART@2.75``: its 4-bit key layers chosen again within 2.75 page bits from the per-layer errors its calibration
  recorded (``key_bits.allocate_key_bits``, ``set_key_clips``: what ``calibrate --key-bits-budget 2.75`` gives
  from the same fit);
* ``ART@2.75h``: 4-bit keys per KV head instead of per layer, the heads whose recorded key attention error 4 bits
  remove most, within the same budget (needs an artifact whose stats hold per-head errors).

Prints one table (KL, ΔPPL, top-1 at each length; page bits; bits per element at 8K and 32K) and the KL of each
window.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace

import torch

from oscar_export.calibration.artifact import load_artifact
from oscar_export.calibration.key_bits import WIDE_BITS, allocate_key_bits, set_key_clips
from oscar_export.eval.cache_models import BF16Cache, PagedInt2
from oscar_export.eval.quantizers import page_roundtrip
from oscar_export.eval.recipes import ours_method
from oscar_export.eval.text import TextScore, final_hidden, max_positions, score_methods, text_windows
from oscar_export.models import load_model


@dataclass(frozen=True, eq=False)
class HeadKeyBits(PagedInt2):
    """Ours with 4-bit keys per KV head: ``wide_heads[layer]`` the heads with wide keys, ``wide_clips[layer]``
    their key clips at that width (the other heads keep the transform's 2-bit clips)."""

    wide_heads: tuple[tuple[int, ...], ...] = ()
    wide_clips: tuple[torch.Tensor, ...] = ()

    def page_rows(self, layer: int, x: torch.Tensor, side: str) -> torch.Tensor:
        narrow = super().page_rows(layer, x, side)
        heads = self.wide_heads[layer]
        if side == "v" or not heads:
            return narrow
        t = replace(self.transforms[layer], k_clip=self.wide_clips[layer].to(x.device))
        wide = page_roundtrip(x, self.layout.with_key_bits(WIDE_BITS), t, "k", self.param_dtype)
        pick = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        pick[list(heads)] = True
        return torch.where(pick[:, None, None], wide, narrow)

    def bits_per_element(self, length: int) -> float:
        h = self.layout.num_kv_heads
        narrow, wide = (self.layout.with_key_bits(b).effective_bits_per_element(length) for b in (2, WIDE_BITS))
        return sum(((h - len(w)) * narrow + len(w) * wide) / h for w in self.wide_heads) / len(self.wide_heads)


def page_bits(method: PagedInt2) -> float:
    """Page bits per element averaged over the layers (and heads)."""
    lay = method.layout
    if isinstance(method, HeadKeyBits):
        h = lay.num_kv_heads
        n2, n4 = (lay.with_key_bits(b).int2_bits_per_element() for b in (2, WIDE_BITS))
        return sum(((h - len(w)) * n2 + len(w) * n4) / h for w in method.wide_heads) / len(method.wide_heads)
    return sum(method.layer_layout(i).int2_bits_per_element() for i in range(len(method.transforms))) / len(
        method.transforms)


def per_head_choice(errors: list, layout, budget: float) -> list[list[int]]:
    """The KV heads given 4-bit keys, best recorded KL gain first, while the page bits averaged over every head of
    every layer stay within ``budget``."""
    h = layout.num_kv_heads
    n2, n4 = (layout.with_key_bits(b).int2_bits_per_element() for b in (2, WIDE_BITS))
    gains = sorted(((e["2"]["heads"]["kl"][j] - e[str(WIDE_BITS)]["heads"]["kl"][j], i, j)
                    for i, e in enumerate(errors) if e is not None for j in range(h)), reverse=True)
    total, chosen = len(errors) * h, [[] for _ in errors]
    for n, (gain, i, j) in enumerate(gains, 1):
        if gain <= 0 or ((total - n) * n2 + n * n4) / total > budget + 1e-9:
            break
        chosen[i].append(j)
    return [sorted(c) for c in chosen]


def build(spec: str, config) -> PagedInt2:
    path, _, budget = spec.partition("@")
    art = load_artifact(path, config)
    method = ours_method(art, spec)
    if budget:
        stats = art.stats["key_bits"]
        lay, errors = art.layout, stats["errors"]
        if budget.endswith("h"):
            heads = per_head_choice(errors, lay, float(budget[:-1]))
            narrow = set_key_clips(art.transforms, (2,) * len(errors), stats)
            clips = tuple(torch.tensor(e[str(WIDE_BITS)]["clip"]) if e else torch.ones(lay.num_kv_heads)
                          for e in errors)
            method = HeadKeyBits(spec, "", layout=lay, transforms=tuple(narrow), wide_heads=tuple(map(tuple, heads)),
                                 wide_clips=clips)
        else:
            gains = [None if e is None else e["2"]["kl"] - e[str(WIDE_BITS)]["kl"] for e in errors]
            chosen = allocate_key_bits(gains, lay, float(budget))
            key_bits = tuple(WIDE_BITS if i in chosen else 2 for i in range(len(errors)))
            method = replace(method, transforms=tuple(set_key_clips(art.transforms, key_bits, stats)),
                             key_bits=key_bits)
    return method


def bf16_hidden(model, ids: torch.Tensor, bf16: BF16Cache, folder: str | None) -> torch.Tensor:
    """BF16's final hidden states of the window ``ids``, kept in ``folder`` (keyed by the window's tokens) so that
    the runs of several processes compute them once."""
    import hashlib
    from pathlib import Path

    if folder is None:
        return final_hidden(model, ids, bf16)
    path = Path(folder) / f"bf16-{hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]}.pt"
    if path.is_file():
        return torch.load(path)
    out = final_hidden(model, ids, bf16)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("caches", nargs="+")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ref-cache", default=None, help="folder keeping BF16's hidden states of each window")
    args = ap.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    t0 = time.perf_counter()
    model, tok = load_model("default")
    methods = [BF16Cache("bf16", "BF16")] + [build(s, model.config) for s in args.caches]
    windows = text_windows(tok, lengths[-1], args.windows, max_positions=max_positions(model), split="dev")
    head, pos = model.get_output_embeddings(), torch.arange(windows.shape[1] - 1)
    scores = {m.name: {L: TextScore() for L in lengths} for m in methods[1:]}
    for i, w in enumerate(windows):
        ref = bf16_hidden(model, w, methods[0], args.ref_cache)
        hidden = {m.name: final_hidden(model, w, m) for m in methods[1:]}
        part = score_methods(lambda c0, c1: head(ref[c0:c1]),
                             {m.name: (lambda c0, c1, g=hidden[m.name]: head(g[c0:c1]), m.reads_quantized(pos))
                              for m in methods[1:]}, w, lengths)
        for name, by_len in part.items():
            for L in lengths:
                scores[name][L].add(by_len[L])
            print(f"[{time.perf_counter() - t0:6.0f} s] window {i + 1}: {name} " + " ".join(
                f"@{L} KL {by_len[L].kl / by_len[L].n:.5f} NLL {by_len[L].nll / by_len[L].n:.5f} ref NLL "
                f"{by_len[L].nll_ref / by_len[L].n:.5f}" for L in lengths), flush=True)
    rows = {m.name: {"page_bits": page_bits(m), "bits_8k": m.bits_per_element(8192),
                     "bits_32k": m.bits_per_element(32768),
                     **{str(L): {**scores[m.name][L].summary(), "per_window_kl": scores[m.name][L].per_window_kl}
                        for L in lengths}} for m in methods[1:]}
    cols = " | ".join(f"KL @{L} | ΔPPL % @{L} | top-1 @{L}" for L in lengths)
    print(f"\n| cache | page bits | bits @8K / 32K | {cols} |\n|" + "---|" * (3 + 3 * len(lengths)))
    for name, r in rows.items():
        cells = " | ".join(f"{r[str(L)]['kl']:.5f} | {r[str(L)]['dppl_pct']:+.2f} | {r[str(L)]['top1']:.3f}"
                           for L in lengths)
        print(f"| {name} | {r['page_bits']:.3f} | {r['bits_8k']:.2f} / {r['bits_32k']:.2f} | {cells} |")
    for name, r in rows.items():
        print(f"{name}: KL per window " + "; ".join(
            f"@{L} " + " ".join(f"{k:.5f}" for k in r[str(L)]["per_window_kl"]) for L in lengths))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/dev_split.py " + " ".join(sys.argv[1:] if argv is None else argv),
                       "windows": int(windows.shape[0]), "seconds": round(time.perf_counter() - t0, 1),
                       "caches": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
