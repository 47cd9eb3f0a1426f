"""The Hopper (Gluon) decode kernel with the query rotated once a step, on 2- and 4-bit key pages, beside SDPA BF16.

    python benchmarks/bench_hopper.py --json out.json
    python benchmarks/bench_hopper.py --heads llama3-8b --shapes 1x8192,8x32768 --key-bits 2,4 --gran token

Per row (one attention layer; CUDA-graph replays over input sets rotated to defeat the L2, median per call):

* ``sdpa_us``: PyTorch SDPA BF16 (GQA) over a BF16 cache of the same tokens;
* ``once_us``: the Hopper kernel fed queries already in the stored key basis (the rotation done once a step,
  by the append launch or one batched product: ``kernels/decode_step.py``), its launch plan's split and fused merge;
* bytes from ``KVCacheLayout.sequence_bytes`` (+ queries and outputs), TB/s and the copy-roofline fraction.

Per (heads, batch), the rotation's own cost in the step: ``append_us`` (``decode_append`` without queries),
``append_q_us`` (the same launch rotating the step's queries: the fused choice) and ``bmm_us`` (``rotate_queries``
compiled by ``torch.compile``: the batched-product choice). ``--warm`` only compiles every kernel variant the
run would launch (so that several processes can fill Triton's cache side by side) and exits.

Heads: Llama-3-8B (32 query / 8 KV heads, head_dim 128) and Gemma-3-12B's (16 / 8, head_dim 256) with one group
per row (``G = 256``: the Hopper kernel's token keys need it; the default layout's ``G = 128`` is read by the
portable kernel, ``portable_us`` on those rows).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from oscar_export.bench import HEADS, copy_tbps, env_line, graph_us, random_state
from oscar_export.bench import input_sets as copies_for
from oscar_export.kernels.decode import hopper
from oscar_export.kernels.decode.portable import decode_attention as portable_decode
from oscar_export.kernels.decode_step import decode_append, rotate_queries
from oscar_export.kernels.layout import KVCacheLayout, RowFormat
from oscar_export.kernels.transform import LayerTransform

SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 32768)]


def layout_for(hkv: int, d: int, gran: str, bits: int, packing: str = "mma16", groups: str = "row") -> KVCacheLayout:
    """``groups``: ``"row"`` one token group a row (G = D) on mma16 pages, ``"default"`` the calibration's G."""
    g = d if packing == "mma16" and groups == "row" else min(d, 128)
    return KVCacheLayout(hkv, d, RowFormat(d, g, gran, packing=packing), RowFormat(d, g, packing=packing),
                         page_size=128).with_key_bits(bits)


def transform(hkv: int, d: int) -> LayerTransform:
    """Non-identity per-head key rotations and scalings (what a calibrated layer has); uniform levels."""
    from dataclasses import replace

    ident = LayerTransform.identity(hkv, d, 0.96, 0.92)
    rot = torch.linalg.qr(torch.randn(hkv, d, d))[0].contiguous()
    return replace(ident, k_rotation=rot, k_scale=torch.rand(hkv, d) + 0.5).to("cuda")


_SDPA: dict[tuple, float] = {}


def sdpa_us(hq: int, hkv: int, d: int, batch: int, seq: int) -> float:
    """SDPA BF16 (GQA) over a BF16 cache of ``seq`` tokens; measured once per shape."""
    key = (hq, hkv, d, batch, seq)
    if key not in _SDPA:
        ssets = copies_for(2 * batch * hkv * seq * d * 2)
        ks = [torch.randn(batch, hkv, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(ssets)]
        vs = [torch.randn_like(k) for k in ks]
        qs = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        _SDPA[key] = graph_us([lambda i=i: F.scaled_dot_product_attention(qs, ks[i], vs[i], scale=d**-0.5,
                                                                          enable_gqa=True) for i in range(ssets)])
    return _SDPA[key]


def _launch(q, st, lay, tr, scale, pps):
    """The Hopper kernel through ``hopper.launch`` (what ``hopper.decode_attention`` runs after its checks), for the
    layouts its wrapper does not take yet (two token groups a row: ``--groups default``, not yet run on a GPU)."""
    return hopper.launch(q, st.sink_k, st.sink_v, st.recent_k, st.recent_v, st.k_codes, st.k_params, st.v_codes,
                         st.v_params, tr.k_levels, tr.v_levels, st.block_table, st.sink_len, st.num_pages,
                         st.recent_len, lay.num_kv_heads, lay.page_size, lay.sink, lay.recent_slots, scale,
                         lay.key.granularity == "channel", pps, torch.bfloat16)


def bench_kernel(hq, hkv, d, batch, seq, gran, bits, copy, warm_only: bool, groups: str = "row") -> dict:
    lay = layout_for(hkv, d, gran, bits, groups=groups)
    tr = transform(hkv, d)
    scale = d**-0.5
    nbytes = batch * lay.sequence_bytes(seq) + 2 * batch * hq * d * 2
    sets = 1 if warm_only else copies_for(nbytes)
    states = [random_state(lay, batch, seq) for _ in range(sets)]
    q_model = [torch.randn(batch, hq, d, device="cuda").bfloat16() for _ in range(sets)]
    q_once = [rotate_queries(q, tr).contiguous() for q in q_model]
    pps = hopper.pages_per_split(batch, hkv, states[0].block_table.shape[1], torch.device("cuda"), d)
    row = dict(heads=f"{hq}/{hkv}x{d}", batch=batch, seq=seq, gran=gran, key_bits=bits, pages_per_split=pps,
               bytes=nbytes, groups=lay.value.group_size)

    def once(i):
        if lay.value.group_size != d:
            return lambda: _launch(q_once[i], states[i], lay, tr, scale, pps)
        return lambda: hopper.decode_attention(q_once[i], states[i], lay, tr.k_levels, tr.v_levels, scale,
                                               out_dtype=torch.bfloat16, pages_per_split=pps)

    if warm_only:
        once(0)()
        torch.cuda.synchronize()
        return row
    row["once_us"] = graph_us([once(i) for i in range(sets)])
    states.clear()  # the graphs are done with them: free the memory before SDPA's cache
    row["sdpa_us"] = sdpa_us(hq, hkv, d, batch, seq)
    row["tbps_once"] = nbytes / row["once_us"] / 1e6
    row["roofline_once"] = (nbytes / copy / 1e6) / row["once_us"]
    row["sdpa_over_once"] = row["sdpa_us"] / row["once_us"]
    return row


def bench_portable(hq, hkv, d, batch, seq, gran, bits) -> dict:
    """The default layout (``G = min(D, 128)``, linear pages) on the portable kernel, queries rotated once."""
    lay = layout_for(hkv, d, gran, bits, "linear")
    tr = transform(hkv, d)
    nbytes = batch * lay.sequence_bytes(seq) + 2 * batch * hq * d * 2
    sets = copies_for(nbytes)
    states = [random_state(lay, batch, seq) for _ in range(sets)]
    qs = [rotate_queries(torch.randn(batch, hq, d, device="cuda").bfloat16(), tr).contiguous() for _ in range(sets)]
    us = graph_us([lambda i=i: portable_decode(qs[i], states[i], lay, tr.k_levels, tr.v_levels, d**-0.5,
                                               out_dtype=torch.bfloat16) for i in range(sets)])
    return dict(heads=f"{hq}/{hkv}x{d}", batch=batch, seq=seq, gran=gran, key_bits=bits, portable_us=us,
                bytes=nbytes, layout="default G=min(D,128), linear")


def _batched_rotation(q: torch.Tensor, rot: torch.Tensor, dsc: torch.Tensor) -> torch.Tensor:
    """``rotate_queries`` on plain tensors (what ``torch.compile`` sees in a step): ``[B, H, D]`` -> fp32."""
    b, h, d = q.shape
    hkv = rot.shape[0]
    return (torch.matmul(q.float().view(b, hkv, h // hkv, d), rot.unsqueeze(0)) / dsc[None, :, None, :]).view(b, h, d)


def bench_rotation(hq, hkv, d, batch, warm_only: bool) -> dict:
    """The rotation's own cost in a step: the append launch without / with the queries, the batched product."""
    lay = layout_for(hkv, d, "channel", 2)
    tr = transform(hkv, d)
    st = random_state(lay, batch, 4096)
    k = torch.randn(batch, hkv, d, device="cuda").bfloat16()
    q = torch.randn(batch, hq, d, device="cuda").bfloat16()
    status = torch.zeros(batch, dtype=torch.int32, device="cuda")
    plain = lambda: decode_append(st, k, k, status, lay, tr, fused_transform=True)  # noqa: E731
    fused = lambda: decode_append(st, k, k, status, lay, tr, fused_transform=True, q=q)  # noqa: E731
    compiled = torch.compile(_batched_rotation)
    bmm = lambda: compiled(q, tr.k_rotation, tr.k_scale)  # noqa: E731
    for f in (plain, fused, bmm):
        f()
    torch.cuda.synchronize()
    row = dict(heads=f"{hq}/{hkv}x{d}", batch=batch)
    if not warm_only:
        row.update(append_us=graph_us([plain] * 8), append_q_us=graph_us([fused] * 8), bmm_us=graph_us([bmm] * 8))
        row["fused_extra_us"] = row["append_q_us"] - row["append_us"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="example: python "
                                 "benchmarks/bench_hopper.py --heads llama3-8b --shapes 1x8192 --key-bits 2,4")
    ap.add_argument("--heads", default="llama3-8b,gemma3-12b")
    ap.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES))
    ap.add_argument("--gran", default="token,channel")
    ap.add_argument("--key-bits", default="2,4")
    ap.add_argument("--portable", action="store_true", help="also the portable kernel on the default layout")
    ap.add_argument("--groups", default="row", choices=("row", "default"),
                    help="mma16 token groups: one a row (G = D) or the calibration's default (G = 128 at D = 256)")
    ap.add_argument("--warm", action="store_true", help="compile every variant once and exit")
    ap.add_argument("--json", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    heads = [HEADS[h] for h in args.heads.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    grans = args.gran.split(",")
    bits = [int(b) for b in args.key_bits.split(",")]
    env = None if args.warm else env_line(args.commit)
    copy = 0.0 if args.warm else copy_tbps()
    if env:
        print(env, f"| copy {copy:.2f} TB/s")
    rows, rot_rows = [], []
    for hq, hkv, d in heads:
        for b in sorted({b for b, _ in shapes}):
            r = bench_rotation(hq, hkv, d, b, args.warm)
            rot_rows.append(r)
            print(json.dumps(r))
        for batch, seq in shapes:
            for gran in grans:
                for kb in bits:
                    r = bench_kernel(hq, hkv, d, batch, seq, gran, kb, copy, args.warm, args.groups)
                    rows.append(r)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}),
                          flush=True)
                    if args.portable and not args.warm:
                        r = bench_portable(hq, hkv, d, batch, seq, gran, kb)
                        rows.append(r)
                        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}),
                              flush=True)
    if args.json and not args.warm:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, copy_tbps=copy, command="python benchmarks/bench_hopper.py " + " ".join(
                argv if argv is not None else __import__("sys").argv[1:]), rows=rows, rotation=rot_rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
