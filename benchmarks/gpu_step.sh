#!/usr/bin/env bash
# The decode step against the hardware's limit, in device calls of under ten minutes each (H100 or H200: every
# ratio is to a baseline timed in the same call). Run from the repository root; files land in $OUT (at most 8).
#
#   OUT=/tmp/s bash benchmarks/gpu_step.sh kernels   # ~330 s
#   OUT=/tmp/s bash benchmarks/gpu_step.sh loop      # ~540 s
#   OUT=/tmp/s bash benchmarks/gpu_step.sh tests     # ~420 s, estimated: never run whole (BOUND=<s>: the tests stage)
#
# kernels:  decode.{json,txt}  bench_decode.py --kernel hopper: the default format (channel keys, mma16 pages, fp32
#                              queries in the stored basis), 1x8K, 1x32K, 1x128K, 8x32K, 2- and 4-bit keys, SDPA BF16
#                              and the copy bandwidth beside it
#           hd256.txt          bench_hopper.py, Gemma-3-12B heads (head_dim 256) at 1x32K with the default layout
#                              (two token groups a row), SDPA beside it
#           append.json        bench_decode.py --append 1,8: the append launch alone, plain and demoting steps
#           profile.json       profile_step.py at 1x32K: the compiled step's kernels by kind, launches a step, idle
# loop:     e2e.json           bench_e2e.py: the README loop at 1x32K, 1x128K, 8x32K beside BF16 StaticCache, the
#                              BF16 roofline of each row, and the equal-KV rows (64 GiB of KV on an H200; 48 on a card
#                              under 100 GiB, where 64 GiB and the weights do not fit)
# tests:    tests.txt          the GPU suite's decode-step and AOT tests (tests/gpu) and the AutoDeploy backend's GPU test,
#                              the bundle built first
#           trtllm_step.json   bench_trtllm_step.py: the TensorRT-LLM adapter's layer, prefill batched vs one per forward,
#                              decode over the scheduled slots
# env.txt (every mode): GPU, versions, commit, date, each stage's return code and time.
set -u
MODE=${1:?usage: gpu_step.sh kernels|loop|tests}
source benchmarks/gpu_env.sh
SHA=${SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}  # pass SHA=: the device copy's git metadata can be stale
stage() { echo "$1 rc $2 at $((SECONDS - start)) s" >> "$OUT/env.txt"; }
if [ "$MODE" = kernels ]; then
  timeout 130 python3 benchmarks/bench_decode.py --kernel hopper --gran channel --key-bits 2,4 \
    --shapes 1x8192,1x32768,1x131072,8x32768 --commit "$SHA" --json "$OUT/decode.json" > "$OUT/decode.txt" 2>&1
  stage decode $?
  timeout 70 python3 benchmarks/bench_hopper.py --heads gemma3-12b --shapes 1x32768 --groups default --gran channel \
    --key-bits 2,4 --commit "$SHA" > "$OUT/hd256.txt" 2>&1
  stage hd256 $?
  timeout 60 python3 benchmarks/bench_decode.py --append 1,8 --key-bits 2,4 --commit "$SHA" --json "$OUT/append.json" \
    > "$OUT/append.txt" 2>&1
  stage append $?
  timeout $((320 - (SECONDS - start))) python3 benchmarks/profile_step.py --workload 1x32768 --caches oscar \
    --commit "$SHA" --json "$OUT/profile.json" > "$OUT/profile.txt" 2>&1
  stage profile $?
  tail -n 14 "$OUT/decode.txt"; tail -n 8 "$OUT/hd256.txt"; tail -n 6 "$OUT/append.txt"; head -n 20 "$OUT/profile.txt"
  rm -f "$OUT/append.txt" "$OUT/install.txt"
elif [ "$MODE" = loop ]; then
  GIB=$(python3 -c "import torch; print(64 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 48)")
  timeout 560 python3 benchmarks/bench_e2e.py --model llama3-8b --workloads 1x32768,1x131072!,8x32768! \
    --caches oscar,bf16 --steps 20 --equal-kv-gib "$GIB" --deadline-s 430 --commit "$SHA" --json "$OUT/e2e.json" \
    > "$OUT/e2e.txt" 2>&1
  stage "e2e (equal KV $GIB GiB)" $?
  tail -n 12 "$OUT/e2e.txt"; rm -f "$OUT/install.txt"
elif [ "$MODE" = tests ]; then
  BUNDLE=$(mktemp -d)/bundle
  timeout 100 python3 -c "
import sys
sys.path.insert(0, 'tests/gpu')
from test_aot_gpu import build
build('$BUNDLE', archs=('sm_90',), ptx_version=None)  # the PTX ISA this Triton's ptxas takes
" > "$OUT/bundle.txt" 2>&1
  stage bundle $?
  # -v: a run cut by its bound still names every test it finished
  OSCAR_AOT_BUNDLE=$BUNDLE timeout $((${BOUND:-290} - (SECONDS - start))) python3 -m pytest -v -m gpu -p no:cacheprovider \
    tests/gpu/test_aot_gpu.py tests/gpu/test_trtllm_gpu.py tests/gpu/test_kernels_gpu.py tests/plugins/test_autodeploy.py \
    -k "${TESTS:-not slow}" > "$OUT/tests.txt" 2>&1
  stage tests $?
  timeout 110 python3 benchmarks/bench_trtllm_step.py --json "$OUT/trtllm_step.json" > "$OUT/trtllm_step.txt" 2>&1
  stage trtllm_step $?
  grep -cE " PASSED" "$OUT/tests.txt"; grep -E "FAILED|ERROR" "$OUT/tests.txt" | head -20; tail -n 3 "$OUT/tests.txt"
  tail -n 6 "$OUT/trtllm_step.txt"
  rm -f "$OUT/install.txt"
fi
cat "$OUT/env.txt"
