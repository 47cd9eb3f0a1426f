#!/usr/bin/env bash
# One H200 call: install, GPU facts, kernel tests (compiled), benchmarks; logs to $OUT, a short table last.
# Usage (device tool, repo root): bash benchmarks/gpu_check.sh [quick|decode|e2e|trt|families|k4]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 - <<'PY' 2>&1 | tee "$OUT/gpu.txt"
import datetime, torch, triton
try:
    import pynvml as n
    n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
    name = n.nvmlDeviceGetName(h); name = name.decode() if isinstance(name, bytes) else name
    mem = n.nvmlDeviceGetMemoryInfo(h).total / 2**30
    clk = lambda t: (n.nvmlDeviceGetClockInfo(h, t), n.nvmlDeviceGetMaxClockInfo(h, t))
    sm, memc = clk(n.NVML_CLOCK_SM), clk(n.NVML_CLOCK_MEM)
    print(f"nvml: {name}, memory {mem:.1f} GiB, SM clock {sm[0]}/{sm[1]} MHz (now/max), memory clock {memc[0]}/{memc[1]} MHz, driver {n.nvmlSystemGetDriverVersion()}")
except Exception as e:
    print("nvml unavailable:", e)
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, triton {triton.__version__}, {p.name}, {p.multi_processor_count} SMs, L2 {p.L2_cache_size/2**20:.0f} MiB, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC")
PY
step() { local name=$1 t=$2; shift 2; echo "=== $name"; timeout "$t" "$@" >"$OUT/$name.log" 2>&1; local rc=$?; echo "=== $name rc=$rc"; tail -n 25 "$OUT/$name.log"; return 0; }
if [ "${1:-}" = e2e ]; then  # serving: HF + kernel GPU tests (TESTS=0 skips), then the end-to-end benchmark
    if [ "${TESTS:-1}" = 1 ]; then
        step hf_gpu_tests 300 python3 -m pytest tests/gpu/test_hf_gpu.py tests/gpu/test_kernels_gpu.py -m gpu -s -q -p no:cacheprovider
        step kernel_tests 150 python3 -m pytest tests/kernels/test_decode_step.py tests/kernels/test_decode_attention.py -q -p no:cacheprovider
    fi
    step bench_e2e "${E2E_TIMEOUT:-400}" python3 benchmarks/bench_e2e.py --model "${MODEL:-llama3-8b}" --workloads "${WORKLOADS:-1x32768}" --caches "${CACHES:-bf16,oscar}" --equal-kv-gib "${EQUAL_GIB:-0}" --steps "${STEPS:-20}" --json "$OUT/bench_e2e.json"
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/hf_gpu_tests.log "$OUT"/kernel_tests.log 2>/dev/null | tail -n 6
    tail -n 20 "$OUT/bench_e2e.log"
    exit 0
fi
if [ "${1:-}" = trt ]; then  # TensorRT-LLM device ops + AOT bundle through the driver API (bundle built on the CPU:
    # `python tests/gpu/test_aot_gpu.py build .aot_bundle`, carried), then the HF/kernel GPU tests as regression
    step trtllm_gpu_tests 200 python3 -m pytest tests/gpu/test_trtllm_gpu.py -m gpu -s -q -p no:cacheprovider
    OSCAR_AOT_BUNDLE=${OSCAR_AOT_BUNDLE:-.aot_bundle} step aot_gpu_tests 200 python3 -m pytest tests/gpu/test_aot_gpu.py -m gpu -s -q -p no:cacheprovider
    [ "${TESTS:-1}" = 1 ] && step hf_gpu_tests 240 python3 -m pytest tests/gpu/test_hf_gpu.py tests/gpu/test_kernels_gpu.py -m gpu -q -p no:cacheprovider
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/*_gpu_tests.log | tail -n 8
    exit 0
fi
if [ "${1:-}" = families ]; then  # issue 14: head_dim 256 kernels, Gemma-3 decode bench, Gemma-3 / Qwen3-MoE HF path
    step families_kernel_tests 150 python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -s -q -p no:cacheprovider -k "head_dim_256"
    step families_bench_decode 150 python3 benchmarks/bench_decode.py --heads "${FAM_HEADS:-gemma3-12b,gemma3-27b}" --gran token,channel --shapes "${FAM_SHAPES:-1x8192,1x32768}" --json "$OUT/bench_decode_families.json" ${COMMIT:+--commit $COMMIT}
    step families_hf 280 python3 benchmarks/families_gpu.py "$OUT/families" --context "${FAM_CONTEXT:-8192}" --steps "${FAM_STEPS:-20}"
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/families_kernel_tests.log 2>/dev/null | tail -n 3
    tail -n 12 "$OUT/families_bench_decode.log"; tail -n 6 "$OUT/families_hf.log"
    exit 0
fi
if [ "${1:-}" = k4 ]; then  # issue 17: 4-bit key pages (GPU tests, the cases earlier calls did not reach), 2- vs 4-bit decode speed
    step k4_gpu_tests "${K4_TEST_S:-120}" python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_hf_gpu.py -m gpu -q -p no:cacheprovider -rA -k "${K4_TESTS:-4bit or mixed_key_bits or append_and_quantize_head_dim_256 or v2_real_shape}"
    step k4_bench_decode "${K4_BENCH_S:-150}" python3 benchmarks/bench_decode.py --shapes "${SHAPES:-1x8192,1x131072,8x32768}" --key-bits 2,4 --json "$OUT/bench_decode_k4.json" ${COMMIT:+--commit $COMMIT}
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/k4_gpu_tests.log 2>/dev/null | tail -n 4
    tail -n 30 "$OUT/k4_bench_decode.log"
    exit 0
fi
if [ "${1:-}" = decode ]; then  # decode attention only: A/B of the split-kernel variants (about 4 minutes)
    step decode_tests 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -s -q -p no:cacheprovider -k "decode_attention_real_shape"
    step bench_decode 420 python3 benchmarks/bench_decode.py --variants "${VARIANTS:-default,slots4,stages3}" --channel-variants "${CH_VARIANTS:-default}" --json "$OUT/bench_decode.json" ${COMMIT:+--commit $COMMIT}
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/decode_tests.log | tail -n 3
    tail -n 50 "$OUT/bench_decode.log"
    exit 0
fi
step gpu_tests 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -s -x -q -p no:cacheprovider
[ "${1:-}" = quick ] || step kernel_tests 150 python3 -m pytest tests/kernels/test_quant_pack.py tests/kernels/test_decode_attention.py -q -x -p no:cacheprovider
step bench_quant 120 python3 benchmarks/bench_quant.py --json "$OUT/bench_quant.json"
step bench_decode 300 python3 benchmarks/bench_decode.py --sweep --json "$OUT/bench_decode.json" ${COMMIT:+--commit $COMMIT}
echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/gpu_tests.log "$OUT"/kernel_tests.log 2>/dev/null | tail -n 4
tail -n 30 "$OUT/bench_decode.log"
