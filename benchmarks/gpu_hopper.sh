#!/usr/bin/env bash
# The Hopper decode kernel on the H200 in one call: its GPU tests (2/4-bit keys, rotation once a step) and
# benchmarks/bench_hopper.py (rotated queries, 2/4-bit keys, token/channel keys, head_dim 128 and 256, SDPA beside).
# Kernel variants are compiled first by parallel --warm processes (one Triton cache) beside the tests; the timings
# run alone after. Eight files land in $OUT. (2026-12-02's run had the head_dim-256 case of
# gluon_head_dims_and_gqa in test_d, cut by its 170 s; test_d and --groups default are the two-group path's first run.)
#   OUT=/tmp/out SHA=<commit> bash benchmarks/gpu_hopper.sh
set -u
OUT=${OUT:-/tmp/gpu_hopper}
W=$(mktemp -d)
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > "$OUT/setup.log"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/setup.log" 2>&1
SHA=${SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
L="--heads llama3-8b --shapes 1x8192"
G="--heads gemma3-12b --shapes 1x32768"
for g in token channel; do for b in 2 4; do
  timeout 170 python3 benchmarks/bench_hopper.py --warm $L --gran $g --key-bits $b > "$W/warm_l_${g}_$b.log" 2>&1 &
  timeout 170 python3 benchmarks/bench_hopper.py --warm $G --gran $g --key-bits $b > "$W/warm_g_${g}_$b.log" 2>&1 &
  timeout 170 python3 benchmarks/bench_hopper.py --warm $G --groups default --gran $g --key-bits $b \
    > "$W/warm_d_${g}_$b.log" 2>&1 &
done; done
T="tests/gpu/test_kernels_gpu.py -m gpu -q -x -s -p no:cacheprovider"
timeout 170 python3 -m pytest $T -k "gluon_real_shape and token-128" > "$W/test_a.log" 2>&1 &
timeout 170 python3 -m pytest $T -k "gluon_real_shape and channel-128" > "$W/test_b.log" 2>&1 &
timeout 170 python3 -m pytest $T -k "gluon_matches_its_emulation or 4bit_mma16_keys_on_gpu or gluon_cuda_graph" > "$W/test_c.log" 2>&1 &
timeout 170 python3 -m pytest $T -k "gluon_two_groups_head_dim_256" > "$W/test_d.log" 2>&1 &
wait
for f in "$W"/warm_*.log; do echo "== $f"; tail -n 3 "$f"; done > "$OUT/warm.log"
for f in "$W"/test_*.log; do echo "== $f"; cat "$f"; done > "$OUT/tests.log"
date -u >> "$OUT/setup.log"
grep -h "passed\|failed\|error" "$W"/test_*.log
timeout 110 python3 benchmarks/bench_hopper.py --heads llama3-8b --commit "$SHA" --json "$OUT/bench_llama.json" > "$OUT/bench_llama.log" 2>&1
timeout 60 python3 benchmarks/bench_hopper.py $G --portable --commit "$SHA" --json "$OUT/bench_gemma.json" > "$OUT/bench_gemma.log" 2>&1
timeout 60 python3 benchmarks/bench_hopper.py $G --groups default --commit "$SHA" --json "$OUT/bench_gemma_g128.json" \
  >> "$OUT/bench_gemma.log" 2>&1
date -u >> "$OUT/setup.log"
cat "$OUT/bench_llama.log" "$OUT/bench_gemma.log"
