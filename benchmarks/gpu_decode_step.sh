#!/usr/bin/env bash
# The decode step's own kernels on the H200 (issue 26): their cold JIT, their GPU tests, the append launch alone and
# the decode kernel beside SDPA BF16. Run from the repository root; everything goes under $OUT; < 240 s.
#
#   OUT=/tmp/k bash benchmarks/gpu_decode_step.sh
#
# $OUT/jit.json      seconds of the first call (fresh Triton cache) minus the second, per kernel variant the README
#                    loop compiles (Llama-3-8B heads, channel keys on mma16 pages: the append launch with the key
#                    transform and the query rotation, the Gluon decode kernel; 2- and 4-bit keys), and their sum,
#                    after a trivial kernel's (Triton's own first use, paid once by any Triton kernel)
# $OUT/tests.txt     tests/gpu/test_kernels_gpu.py: the decode step's tests (append, CUDA graph, custom ops: 10 tests, 7 of them in 75 s on 12-02)
# $OUT/append.*      bench_decode.py --append 1,8: the append launch alone, plain and demoting steps
# $OUT/decode.*      bench_decode.py --kernel hopper: 1x8K, 1x32K, 1x128K, 8x32K, 2- and 4-bit keys, beside SDPA
source benchmarks/gpu_env.sh

TRITON_CACHE_DIR=$(mktemp -d) timeout 60 python3 - > "$OUT/jit.json" 2> "$OUT/jit.err" <<'PY'
import json
import time

import torch
import triton
import triton.language as tl

from oscar_export.bench import random_state
from oscar_export.kernels import triton_ops
from oscar_export.kernels.layout import KVCacheLayout
from oscar_export.kernels.transform import LayerTransform

hq, hkv, d = 32, 8, 128
rows = {}


@triton.jit
def _one(x_ptr):
    tl.store(x_ptr, 1.0)


def twice(name, fn):
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rows[name] = round(times[0] - times[1], 3)


# Triton's own first-use costs (its CUDA helper module, built on a fresh cache), which any Triton kernel pays once
twice("triton_first_use", lambda: _one[(1,)](torch.empty(1, device="cuda")))
for bits in (2, 4):
    lay = KVCacheLayout.default(hkv, d, "channel").with_packing("mma16").with_key_bits(bits)
    tr = LayerTransform.identity(hkv, d, 0.96, 0.92).to("cuda")
    st = random_state(lay, 1, 8192)
    k = torch.randn(1, hkv, d, device="cuda").bfloat16()
    q = torch.randn(1, hq, d, device="cuda").bfloat16()
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    twice(f"append_k{bits}", lambda: triton_ops.decode_append(st, k, k, status, lay, tr, fused_transform=True, q=q))
    q_s = torch.randn(1, hq, d, device="cuda")
    twice(f"decode_k{bits}", lambda: triton_ops.decode_attention(q_s, st, lay, tr.k_levels, tr.v_levels, d**-0.5,
                                                                 out_dtype=torch.bfloat16))
rows["sum_of_the_four"] = round(sum(v for n, v in rows.items() if n != "triton_first_use"), 3)
print(json.dumps(rows))
PY
echo "jit done at $((SECONDS - start)) s" >> "$OUT/env.txt"

timeout 110 python3 -m pytest tests/gpu/test_kernels_gpu.py -q -x -m gpu \
  -k "decode_append or decode_step_cuda_graph or custom_ops" > "$OUT/tests.txt" 2>&1
echo "tests rc $? at $((SECONDS - start)) s" >> "$OUT/env.txt"

timeout 55 python3 benchmarks/bench_decode.py --append 1,8 --key-bits 2,4 --json "$OUT/append.json" \
  > "$OUT/append.txt" 2>&1
echo "append rc $? at $((SECONDS - start)) s" >> "$OUT/env.txt"

timeout $((225 - (SECONDS - start))) python3 benchmarks/bench_decode.py --kernel hopper --gran channel \
  --key-bits 2,4 --shapes 1x8192,1x32768,1x131072,8x32768 --json "$OUT/decode.json" > "$OUT/decode.txt" 2>&1
echo "decode rc $? at $((SECONDS - start)) s" >> "$OUT/env.txt"
