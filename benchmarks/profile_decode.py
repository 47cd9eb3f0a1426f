"""One decode-attention call per variant and shape, for Nsight Compute (stall reasons per SASS line).

    ncu --clock-control none -k regex:_decode_split --section WarpStateStats --section SchedulerStats \
        --section SourceCounters -o rep python3 benchmarks/profile_decode.py --shape 1x131072 --variant default
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv

Same random cache as bench_decode.py (32 query / 8 KV heads, head_dim 128, token keys). ``--hopper`` profiles the
hopper (Gluon) kernel instead (``kernels/decode/hopper.py``) on the same tokens in mma16 pages.
"""

from __future__ import annotations

import argparse

import torch

from bench_decode import HKV, HQ, D, VARIANTS, mma16_copy, random_state  # noqa: E402  (same folder)
from oscar_export.kernels.decode.portable import decode_attention
from oscar_export.kernels.layout import KVCacheLayout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x131072")
    ap.add_argument("--variant", default="default", help=f"one of {sorted(VARIANTS)}")
    ap.add_argument("--hopper", action="store_true", help="the hopper (Gluon) kernel on mma16 pages")
    ap.add_argument("--gran", default="token")
    ap.add_argument("--q-rotation", action="store_true", help="queries in the model basis, the key rotation fused "
                    "into the kernel (as serving launches it for rotated keys)")
    args = ap.parse_args()
    b, s = (int(x) for x in args.shape.split("x"))
    lay = KVCacheLayout.default(HKV, D, args.gran)
    st = random_state(lay, b, s)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    lev = torch.tensor([0.0, 1.0, 2.0, 3.0], device="cuda").repeat(HKV, 1)
    rot = None
    if args.q_rotation:
        rot = (torch.linalg.qr(torch.randn(HKV, D, D, device="cuda"))[0].contiguous(),
               torch.rand(HKV, D, device="cuda") + 0.5)
    if args.hopper:
        from oscar_export.kernels.decode import hopper

        st, lay = mma16_copy(st, lay)
        call = lambda: hopper.decode_attention(q, st, lay, lev, lev, D**-0.5, out_dtype=torch.bfloat16,  # noqa: E731
                                               q_rotation=rot)
    else:
        call = lambda: decode_attention(q, st, lay, lev, lev, D**-0.5, out_dtype=torch.bfloat16,  # noqa: E731
                                        q_rotation=rot, **VARIANTS[args.variant])
    for _ in range(2):  # the first call compiles
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
