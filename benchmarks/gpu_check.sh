#!/usr/bin/env bash
# One H200 call: install, GPU facts, kernel tests (compiled), benchmarks; logs to $OUT, a short table last.
# Usage (device tool, repo root): bash benchmarks/gpu_check.sh [quick|decode|e2e|trt|families|v2|v3|v3e2e|v3fm|v3prof|v3sweep|k4|k4e2e]
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
    step bench_e2e "${E2E_TIMEOUT:-400}" python3 benchmarks/bench_e2e.py --model "${MODEL:-llama3-8b}" --workloads "${WORKLOADS:-1x8192}" --caches "${CACHES:-oscar,bf16-static,bf16-dynamic}" --equal-kv-gib "${EQUAL_GIB:-0}" --steps "${STEPS:-20}" --json "$OUT/bench_e2e.json" ${COMMIT:+--commit $COMMIT}
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
if [ "${1:-}" = v3 ]; then  # issue 11: the Gluon kernel's and the mma16 writers' GPU tests, the writers linear vs mma16, then v1 / v2 / v3 / SDPA at the issue's shapes (~8 min)
    step v3_gpu_tests "${V3_TEST_S:-150}" python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -s -q -p no:cacheprovider -rA -k "gluon or mma16"
    step v3_bench_quant "${V3_QUANT_S:-90}" python3 benchmarks/bench_quant.py --packing linear,mma16 --json "$OUT/bench_quant_mma16.json"
    step v3_bench_decode "${V3_BENCH_S:-300}" python3 benchmarks/bench_decode.py --shapes "${SHAPES:-1x8192,1x131072,8x32768,32x32768}" --kernels v1,v2 --v2-variants "${V2_VARIANTS:-default,gluon,gluon-s2,gluon-s4}" --json "$OUT/bench_decode_v3.json" ${COMMIT:+--commit $COMMIT}
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/v3_gpu_tests.log 2>/dev/null | tail -n 6
    tail -n 16 "$OUT/v3_bench_quant.log"; tail -n 40 "$OUT/v3_bench_decode.log"
    exit 0
fi
if [ "${1:-}" = v3prof ]; then  # issue 11: Nsight Compute on v3 (stalls per SASS line), its AOT bundle on the GPU, the e2e step's idle gaps
    # (NCU_CFGS: shape:gran:variant[:rot], rot = the query rotation fused)
    for cfg in ${NCU_CFGS:-32x32768:token:gluon 32x32768:channel:gluon 32x32768:token:gluon-r128 8x32768:token:gluon 1x8192:token:gluon}; do
        IFS=: read -r shape gran var rot <<<"$cfg"; tag="ncu_${shape}_${gran}_${var}${rot:+_$rot}"
        step "$tag" 150 ncu --clock-control none -k regex:_decode_split --launch-count 1 --section SpeedOfLight \
            --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
            --section MemoryWorkloadAnalysis --section SourceCounters -o "$OUT/$tag" \
            python3 benchmarks/profile_decode.py --shape "$shape" --gran "$gran" --v2-variant "$var" ${rot:+--q-rotation}
        ncu --import "$OUT/$tag.ncu-rep" --page details --csv >"$OUT/$tag.details.csv" 2>&1
        ncu --import "$OUT/$tag.ncu-rep" --page source --csv --print-source sass >"$OUT/$tag.sass.csv" 2>&1
        rm -f "$OUT/$tag.ncu-rep"
    done
    [ "${AOT:-1}" = 1 ] && step aot_gluon 200 python3 -m pytest tests/gpu/test_aot_gpu.py -m gpu -s -q -p no:cacheprovider -rA -k gluon
    [ "${E2E:-1}" = 1 ] && step v3_e2e_gaps "${E2E_TIMEOUT:-200}" python3 benchmarks/bench_e2e.py --workloads 1x32768! --caches "${CACHES:-oscar-graph,oscar-graph-v3}" --steps "${STEPS:-10}" --json "$OUT/bench_e2e_gaps.json" ${COMMIT:+--commit $COMMIT}
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/aot_gluon.log 2>/dev/null | tail -n 4
    exit 0
fi
if [ "${1:-}" = v3sweep ]; then  # issue 11: v3 pages per split and register cap, per shape (SWEEP = shape:pps,pps,...)
    for cfg in ${SWEEP:-1x8192:1,2,3,4 1x32768:2,4,6,8 1x131072:8,12,16,20,24,32 8x32768:16,22,29,43,64 32x32768:43,64,86,128}; do
        IFS=: read -r shape pps <<<"$cfg"
        step "sweep_$shape" "${SWEEP_S:-90}" python3 benchmarks/bench_decode.py --shapes "$shape" --gran "${GRAN:-token,channel}" --kernels v1,v2 --v2-variants "${V2_VARIANTS:-gluon,gluon-r128}" --v2-pps "bench,$pps" --json "$OUT/sweep_$shape.json" ${COMMIT:+--commit $COMMIT}
    done
    exit 0
fi
if [ "${1:-}" = v3e2e ]; then  # issue 11: the whole decode step with v1 / v2 / v3 pages and kernels, and at equal KV memory (~6 min)
    step v3_e2e "${E2E_TIMEOUT:-420}" python3 benchmarks/bench_e2e.py --workloads "${WORKLOADS:-1x32768!}" --caches "${CACHES:-oscar-graph,oscar-graph-v2,oscar-graph-v3,bf16-static}" --equal-kv-gib "${EQUAL_GIB:-64}" --equal-oscar oscar-graph,oscar-graph-v2,oscar-graph-v3 --steps "${STEPS:-20}" --json "$OUT/bench_e2e_v3.json" ${COMMIT:+--commit $COMMIT}
    tail -n 20 "$OUT/v3_e2e.log"
    exit 0
fi
if [ "${1:-}" = v3fm ]; then  # issue 11: v3 with the merge fused into its split kernel vs its own launch: GPU tests, then
    # bench_decode with plain and rotated queries (~6 min)
    step fm_gpu_tests 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -s -q -p no:cacheprovider -k "${TESTK:-gluon}"
    step fm_bench 240 python3 benchmarks/bench_decode.py --shapes "${SHAPES:-1x8192,1x32768,1x131072,8x32768,32x32768}" --kernels v1,v2 --v2-variants "${V2_VARIANTS:-gluon-sm,gluon-fm}" --json "$OUT/bench_decode_fm.json" ${COMMIT:+--commit $COMMIT}
    step fm_bench_rot 150 python3 benchmarks/bench_decode.py --shapes "${ROT_SHAPES:-1x8192,1x32768,8x32768}" --gran token --kernels v2 --q-rotation --v2-variants "${V2_VARIANTS:-gluon-sm,gluon-fm}" --json "$OUT/bench_decode_fm_rot.json" ${COMMIT:+--commit $COMMIT}
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/fm_gpu_tests.log | tail -n 4
    tail -n 24 "$OUT/fm_bench.log"; tail -n 10 "$OUT/fm_bench_rot.log"
    (cd "$OUT" && tar czf fm.tgz *.log *.json gpu.txt && rm -f *.log *.json)
    exit 0
fi
if [ "${1:-}" = v2 ]; then  # mma16 pages + the v2 decode kernel: GPU tests, compiled kernel tests, v1/v2/SDPA bench (~4 min)
    step v2_gpu_tests 150 python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -s -q -p no:cacheprovider -k "mma16 or v2"
    step v2_kernel_tests 120 python3 -m pytest tests/kernels/test_decode_attention_v2.py tests/kernels/test_quant_pack.py tests/kernels/test_decode_step.py -q -p no:cacheprovider -k "v2 or mma16"
    step v2_bench_decode 240 python3 benchmarks/bench_decode.py --shapes "${SHAPES:-1x8192,1x131072,8x32768}" --kernels v1,v2 --v2-variants "${V2_VARIANTS:-default,w4,plain,tile}" --json "$OUT/bench_decode_v2.json" ${COMMIT:+--commit $COMMIT}
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/v2_gpu_tests.log "$OUT"/v2_kernel_tests.log 2>/dev/null | tail -n 6
    tail -n 30 "$OUT/v2_bench_decode.log"
    exit 0
fi
if [ "${1:-}" = k4e2e ]; then  # issue 17: the 4-bit GPU tests, then the serving benchmark with 4-bit keys in K4_LAYERS
    step k4_gpu_tests "${K4_TEST_S:-150}" python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_hf_gpu.py -m gpu -q -p no:cacheprovider -rA -k "${K4_TESTS:-4bit or mixed_key_bits}"
    step bench_e2e "${E2E_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py --workloads "${WORKLOADS:-1x32768}" --caches "${CACHES:-oscar-graph,oscar-graph-k4,bf16-static}" --k4-layers "${K4_LAYERS:-0-15}" --equal-kv-gib "${EQUAL_GIB:-64}" --equal-oscar oscar-graph,oscar-graph-k4 --steps "${STEPS:-20}" --json "$OUT/bench_e2e_k4.json" ${COMMIT:+--commit $COMMIT}
    echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/k4_gpu_tests.log 2>/dev/null | tail -n 4
    tail -n 12 "$OUT/bench_e2e.log"
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
