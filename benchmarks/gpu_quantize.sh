#!/usr/bin/env bash
# The page quantizer (prefill write, demotion) against the copy bandwidth (the quantize / demote target of docs/kernels.md).
# Run from the repository root; everything goes under $OUT; < 200 s (each stage has its own timeout). Not yet run on a GPU.
#
#   OUT=/tmp/p bash benchmarks/gpu_quantize.sh
#
# $OUT/env.txt     GPU, versions, git, and each stage's seconds and return code
# $OUT/bench.*     benchmarks/bench_quant.py --packing linear,mma16: prefill write, token and channel keys, 64 and
#                  1024 pages (each variant first checked bit-exact against the reference on the GPU), +rot,
#                  demote+append, beside the device copy bandwidth (json + the printed table)
# $OUT/tests.txt   the quantizer's GPU tests: tests/gpu/test_kernels_gpu.py -k quantize (bit-exact vs the reference,
#                  real shapes, linear and mma16 pages, 2- and 4-bit keys, head_dim 256), then, with time left,
#                  tests/gpu/test_aot_gpu.py -k quant_pack (the AOT bundle's quantizer)
source benchmarks/gpu_env.sh

t=$SECONDS
timeout 90 python3 benchmarks/bench_quant.py --packing linear,mma16 --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
echo "bench_quant: rc $? $((SECONDS - t)) s" >> "$OUT/env.txt"

t=$SECONDS
left=$((190 - (SECONDS - start)))
if [ "$left" -gt 15 ]; then
  timeout "$left" python3 -m pytest tests/gpu/test_kernels_gpu.py -q -m gpu -k quantize -p no:cacheprovider \
    > "$OUT/tests.txt" 2>&1
  echo "tests (kernels -k quantize): rc $? $((SECONDS - t)) s" >> "$OUT/env.txt"
fi
t=$SECONDS
left=$((195 - (SECONDS - start)))
if [ "$left" -gt 15 ]; then
  timeout "$left" python3 -m pytest tests/gpu/test_aot_gpu.py -q -m gpu -k quant_pack -p no:cacheprovider \
    >> "$OUT/tests.txt" 2>&1
  echo "tests (aot -k quant_pack): rc $? $((SECONDS - t)) s" >> "$OUT/env.txt"
else
  echo "tests (aot -k quant_pack): skipped, ${left} s left" >> "$OUT/env.txt"
fi
echo "total: $((SECONDS - start)) s" >> "$OUT/env.txt"
