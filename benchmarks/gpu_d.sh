#!/usr/bin/env bash
# Helper D (issue 30) on the H200 in one call (< 240 s): what this session's clean-up moved, run on a GPU once.
# Four processes side by side on the one GPU (their times are perturbed: this checks that they run and agree, the
# numbers of record stay docs/kernels.md's):
#  1. tests/gpu/test_hf_gpu.py -k auto_backend_is_triton: the Triton backend against the reference ops with identity
#     and rotated keys (the rotated artifact is now oscar_export.bench.random_artifact, the check
#     assert_triton_matches_torch);
#  2. bench_hopper.py and 3. bench_quant.py, which now take graph_us / input_sets / copy_tbps / env_line from
#     oscar_export.bench instead of importing the bench_decode script;
#  4. oscar-export bench --shapes 1x8192 (its first line now names the commit).
#   OUT=/tmp/out bash benchmarks/gpu_d.sh
set -u
OUT=${OUT:-/tmp/gpu_d}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; git rev-parse --short HEAD; } \
  > "$OUT/setup.log" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/setup.log" 2>&1
timeout 200 python3 -m pytest tests/gpu/test_hf_gpu.py -m gpu -q -x -s -p no:cacheprovider -k auto_backend_is_triton \
  > "$OUT/test_hf_gpu.log" 2>&1 &
timeout 200 python3 benchmarks/bench_hopper.py --heads llama3-8b --shapes 1x8192 --gran token --key-bits 2 \
  --json "$OUT/hopper.json" > "$OUT/hopper.log" 2>&1 &
timeout 200 python3 benchmarks/bench_quant.py --json "$OUT/quant.json" > "$OUT/quant.log" 2>&1 &
timeout 200 oscar-export bench --shapes 1x8192 --json "$OUT/bench_cli.json" > "$OUT/bench_cli.log" 2>&1 &
wait
date -u >> "$OUT/setup.log"
tail -n 3 "$OUT/test_hf_gpu.log"; head -n 3 "$OUT/hopper.log"; tail -n 12 "$OUT/quant.log"; cat "$OUT/bench_cli.log"
