"""Quantize/pack (prefill write) and decode-step demotion on the GPU, as a fraction of the copy bandwidth.

    python benchmarks/bench_quant.py [--json out.json] [--sweep] [--packing linear,mma16]

8 KV heads, head_dim 128, P = 128. Bytes = bytes read + bytes written, from the layout's shapes:
prefill write reads the BF16 rows and writes codes + params; ``+rot`` also fuses ``(x @ R) * d - mu``;
demotion (every sequence due at once) reads P rows of K and V, writes a page and shifts W rows left
(read + write) and appends the new token; its counters are reset between calls by two tiny fills, which
the time includes. Medians of CUDA-graph replays over rotated input sets.

Before timing, every prefill-write variant is checked bit-exact against ``reference.quantize_pages`` on
the same GPU (64 pages, clips 1.0 .. 0.5, so the multi-round threshold path runs too); ``+rot`` within the
tests' tolerance. ``--sweep`` adds the launch widths (``num_warps`` 1/2/4/8) and the fused in-kernel rotation.
``--packing linear,mma16`` also runs the rows on mma16 pages (the Hopper decode kernel's order; there the value
pool is written transposed, so a value-page write row is added).
"""

from __future__ import annotations

import argparse
import json

import torch

from oscar_export.bench import copy_tbps, env_line, graph_us
from oscar_export.bench import input_sets as copies_for
from oscar_export.kernels import reference as ref
from oscar_export.kernels.decode_step import decode_append
from oscar_export.kernels.layout import KVCacheLayout, PagedKV
from oscar_export.kernels.quant_pack import quantize_pages, write_pages
from oscar_export.kernels.transform import LayerTransform

H, D = 8, 128


def check_write(gran: str, rotate: bool, packing: str = "linear", operand: str = "key", **kw) -> str:
    """Bit-exact (plain) or within tolerance (rotation) against the reference on this GPU; raises if not."""
    lay = KVCacheLayout.default(H, D, gran, packing=packing)
    fmt = lay.key if operand == "key" else lay.value
    x = (torch.randn(64, H, lay.page_size, D, device="cuda") * torch.linspace(0.1, 3, D, device="cuda")).bfloat16()
    clip = torch.tensor([1.0, 0.99, 0.96, 0.94, 0.92, 0.87, 0.75, 0.5], device="cuda")
    lev = torch.tensor([0.0, 1.0, 2.0, 3.0], device="cuda").repeat(H, 1)
    rot = None
    if rotate:
        r = torch.linalg.qr(torch.randn(H, D, D, device="cuda"))[0].contiguous()
        rot = (r, torch.rand(H, D, device="cuda") + 0.5, torch.randn(H, D, device="cuda") * 0.1)
    got = quantize_pages(x, lay, fmt, clip, lev, rot, operand=operand, **kw)
    xs = x.float() if rot is None else ((torch.matmul(x.float(), rot[0]) * rot[1][:, None] - rot[2][:, None])
                                        .bfloat16().float())
    want = ref.quantize_pages(xs, fmt, clip, lev, operand)
    if rot is None:
        for name, g, w in zip(("codes", "params"), got, want):
            if not torch.equal(g, w):
                raise AssertionError(f"{gran} {kw}: {name} differ from the reference at {(g != w).sum().item()} places")
        return "exact"
    flips = (ref.unpack_page_codes(got[0], fmt, operand) != ref.unpack_page_codes(want[0], fmt, operand))
    frac = flips.float().mean().item()
    if frac > 2e-3:
        raise AssertionError(f"{gran} +rot {kw}: {frac:.2%} of codes flipped (tolerance 0.2%)")
    return f"{frac:.1e} flips"


def bench_write(n_pages: int, gran: str, rotate: bool, packing: str = "linear", operand: str = "key", **kw) -> dict:
    check = check_write(gran, rotate, packing, operand, **kw)
    lay = KVCacheLayout.default(H, D, gran, packing=packing)
    fmt = lay.key if operand == "key" else lay.value
    clip = torch.full((H,), 0.96, device="cuda")
    lev = torch.tensor([0.0, 1.0, 2.0, 3.0], device="cuda").repeat(H, 1)
    rot = None
    if rotate:
        r = torch.linalg.qr(torch.randn(H, D, D, device="cuda"))[0].contiguous()
        rot = (r, torch.ones(H, D, device="cuda"), torch.zeros(H, D, device="cuda"))
    in_bytes = n_pages * H * lay.page_size * D * 2
    out_bytes = n_pages * H * (lay.page_size * fmt.bytes_per_row_codes + fmt.param_bytes_per_page(lay.page_size))
    sets = copies_for(in_bytes)
    xs = [torch.randn(n_pages, H, lay.page_size, D, device="cuda").bfloat16() for _ in range(sets)]
    codes = torch.empty(lay.codes_shape(n_pages * sets, fmt), dtype=torch.uint8, device="cuda")
    params = torch.empty(lay.params_shape(fmt, n_pages * sets), dtype=torch.float16, device="cuda")
    ids = [torch.arange(i * n_pages, (i + 1) * n_pages, dtype=torch.int32, device="cuda") for i in range(sets)]
    fns = [lambda i=i: write_pages(xs[i], ids[i], codes, params, lay, fmt, clip, lev, rot, operand=operand, **kw)
           for i in range(sets)]
    us = graph_us(fns)
    nbytes = in_bytes + out_bytes
    variant = ",".join(f"{k}={v}" for k, v in kw.items()) or "default"
    return dict(op="prefill write" + (" +rot" if rotate else "") + ("" if operand == "key" else " (V)"), gran=gran,
                pages=n_pages, variant=variant, packing=packing, check=check, bytes=nbytes, us=us,
                tbps=nbytes / (us * 1e-6) / 1e12)


def bench_demote(batch: int, gran: str, packing: str = "linear") -> dict:
    lay = KVCacheLayout.default(H, D, gran, packing=packing)
    tr = LayerTransform.identity(H, D, 0.96, 0.92).to("cuda")
    p, cap = lay.page_size, lay.recent_capacity
    sets = 2
    states = []
    for _ in range(sets):
        st = PagedKV.allocate(lay, batch, batch * 4, 4, device="cuda")
        st.recent_k.normal_()
        st.recent_v.normal_()
        st.block_table.copy_(torch.arange(batch * 4, dtype=torch.int32, device="cuda").view(batch, 4))
        st.sink_len.fill_(lay.sink)
        states.append(st)
    k = torch.randn(batch, H, D, device="cuda")
    v = torch.randn(batch, H, D, device="cuda")
    status = torch.zeros(batch, dtype=torch.int32, device="cuda")

    def step(st):
        st.recent_len.fill_(cap)
        st.num_pages.fill_(1)
        decode_append(st, k, v, status, lay, tr)

    us = graph_us([lambda st=st: step(st) for st in states])
    row_bytes = H * D * 2
    nbytes = batch * (2 * p * row_bytes + 2 * (lay.page_bytes() // 2)  # read P K+V ring rows, write one page
                      + 2 * row_bytes)  # append (the ring moves nothing)
    return dict(op="demote+append", gran=gran, pages=batch, variant="default", packing=packing, check="tests",
                bytes=nbytes, us=us, tbps=nbytes / (us * 1e-6) / 1e12)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also num_warps 1/2/4/8 and the fused rotation")
    ap.add_argument("--packing", default="linear", help="comma list of page packings: linear, mma16")
    args = ap.parse_args(argv)
    print(env_line())
    bw = copy_tbps()
    print(f"device copy: {bw:.2f} TB/s (read + write)")
    rows = []
    for packing in args.packing.split(","):
        for gran in ("token", "channel"):
            for n in (64, 1024):
                rows.append(bench_write(n, gran, rotate=False, packing=packing))
            if packing == "mma16":  # the value pool is the transposed [D, P] matrix there
                rows.append(bench_write(1024, gran, rotate=False, packing=packing, operand="value"))
            rows.append(bench_write(1024, gran, rotate=True, packing=packing))
            rows.append(bench_demote(64, gran, packing))
            if args.sweep:
                for w in (1, 2, 4, 8):
                    rows.append(bench_write(1024, gran, rotate=False, packing=packing, num_warps=w))
                rows.append(bench_write(1024, gran, rotate=True, packing=packing, fused_rotation=True))
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env_line(), copy_tbps=bw, rows=rows), f, indent=1)
    print(f"\n{'op':>22} {'gran':>7} {'packing':>7} {'pages':>6} {'variant':>20} {'MB':>8} {'us':>8} {'TB/s':>6} "
          f"{'% copy':>6}  check")
    for r in rows:
        print(f"{r['op']:>22} {r['gran']:>7} {r['packing']:>7} {r['pages']:>6} {r['variant']:>20} "
              f"{r['bytes'] / 1e6:8.1f} {r['us']:8.1f} {r['tbps']:6.2f} {100 * r['tbps'] / bw:6.1f}  {r['check']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
