#!/usr/bin/env bash
# Issue 26 on the H200 in one call (<= 400 s): the query rotation once a step, wired into serving (every decode
# backend reads stored-basis queries that the append launch rotated), and where the README loop's compile goes.
#  1. GPU tests, five pytest processes side by side (each JIT-compiles its kernels; one Triton cache):
#     test_hf_gpu.py: triton backend == reference ops with identity and rotated keys; torch.cuda.graph replay ==
#     eager across a demotion (rotated keys); generate with a compile_config (rotated keys); the README loop with a
#     calibrated-shape artifact vs eager from the same cache. test_kernels_gpu.py: the two custom ops (append
#     rotating the queries) under torch.compile == eager; the HF triton backend vs the reference; the decode step
#     in one CUDA graph; and the hopper kernel's head_dim 256 with two groups a row (Gemma 3), alone.
#  2. bench_e2e.py --jit-only: the seconds the README loop's decode step spends in the JIT of its kernels (the
#     Llama-3-8B attention shape, 4- and 2-bit key layers, fresh compile caches).
#   OUT=/tmp/out bash benchmarks/gpu_k26.sh
set -u
OUT=${OUT:-/tmp/gpu_k26}
W=$(mktemp -d)
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > "$OUT/setup.log"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/setup.log" 2>&1
SHA=${SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
H="tests/gpu/test_hf_gpu.py -m gpu -q -s -p no:cacheprovider"
K="tests/gpu/test_kernels_gpu.py -m gpu -q -s -p no:cacheprovider"
timeout 230 python3 -m pytest $H -k "auto_backend" > "$W/hf_a.log" 2>&1 &
timeout 230 python3 -m pytest $H -k "cuda_graph_equals_eager or generate_with_a_compile_config" > "$W/hf_b.log" 2>&1 &
timeout 230 python3 -m pytest $H -k "readme_loop" > "$W/hf_c.log" 2>&1 &
timeout 230 python3 -m pytest $K -k "custom_ops_under_torch_compile or hf_triton_backend_matches or decode_step_cuda_graph" \
  > "$W/kern_a.log" 2>&1 &
timeout 230 python3 -m pytest $K -k "gluon_two_groups_head_dim_256" > "$W/kern_b.log" 2>&1 &
wait
for f in "$W"/hf_*.log; do echo "== $f"; grep -v "^DEBUG" "$f"; done > "$OUT/hf.log"
for f in "$W"/kern_*.log; do echo "== $f"; cat "$f"; done > "$OUT/kern.log"
date -u >> "$OUT/setup.log"
timeout 120 python3 benchmarks/bench_e2e.py --model llama3-8b --jit-only --commit "$SHA" --json "$OUT/jit.json" \
  > "$OUT/jit.log" 2>&1
date -u >> "$OUT/setup.log"
{
  echo "# gpu_k26 at $SHA"
  for f in "$W"/*.log; do echo "$(basename "$f"): $(grep -E "[0-9]+ (passed|failed)|error" "$f" | tail -n 1)"; done
  grep -h "max relative logit error\|greedy tokens agree" "$W"/hf_*.log
  tail -n 1 "$OUT/jit.log"
} | tee "$OUT/SUMMARY.md"
