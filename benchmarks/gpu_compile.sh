#!/usr/bin/env bash
# Compile time of the README loop's step on the GPU, as a new user meets it: one fresh process per cache (empty
# Triton and Inductor cache folders, nothing compiled before), Llama-3-8B shape at 1x32K, then the precompile GPU
# tests (the first eager and compiled step find the kernels the workers compiled). Run from the repository root;
# everything goes under $OUT; about 5 minutes on the H200.
#
#   OUT=/tmp/c bash benchmarks/gpu_compile.sh
#
# $OUT/cold-{oscar,bf16}.json   bench_e2e.py rows: compile_s split (Dynamo / Inductor / first run), Inductor's own
#                               timers (compile_timers), the kernels the first call compiled in-process (jit_kernels)
# $OUT/tests.txt                tests/gpu/test_precompile_gpu.py
source benchmarks/gpu_env.sh
for c in ${CACHES:-oscar bf16}; do
  timeout 240 python3 benchmarks/bench_e2e.py --model llama3-8b --workloads 1x32768 --caches "$c" --steps 10 \
      --json "$OUT/cold-$c.json" ${COMMIT:+--commit "$COMMIT"} > "$OUT/cold-$c.log" 2>&1
  tail -n 3 "$OUT/cold-$c.log"
done
timeout 200 python3 -m pytest tests/gpu/test_precompile_gpu.py -m gpu -q -x > "$OUT/tests.txt" 2>&1
tail -n 5 "$OUT/tests.txt"
