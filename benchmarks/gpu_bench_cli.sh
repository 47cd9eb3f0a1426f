#!/usr/bin/env bash
# `oscar-export bench` (oscar_export/bench.py, the packaged decode benchmark) on the H200, first run: the serving
# kernel select_backend picks per shape against SDPA BF16 and the copy roofline. Four files land in $OUT
# (setup.log, bench.log, bench_llama.json, bench_gemma.json); at most 350 s, mostly the kernels' JIT.
#   OUT=/tmp/out bash benchmarks/gpu_bench_cli.sh
set -u
OUT=${OUT:-/tmp/gpu_bench_cli}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; git rev-parse --short HEAD; } > "$OUT/setup.log" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/setup.log" 2>&1
timeout 200 oscar-export bench --json "$OUT/bench_llama.json" 2>&1 | tee "$OUT/bench.log"
timeout 150 oscar-export bench --heads gemma3-12b --shapes 1x32768 --keys token,channel --key-bits 2,4 \
  --json "$OUT/bench_gemma.json" 2>&1 | tee -a "$OUT/bench.log"
date -u >> "$OUT/setup.log"
