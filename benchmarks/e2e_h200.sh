#!/usr/bin/env bash
# One H200 call for issue 26 (helper K-b): the README-loop benchmark, then the HF GPU tests of the compiled path.
#   run: bash benchmarks/e2e_h200.sh   (writes $OUT/e2e.json, $OUT/e2e.log, $OUT/hf_gpu.log)
set -u
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1
export TORCHINDUCTOR_FX_GRAPH_CACHE=1
timeout 280 python3 benchmarks/bench_e2e.py --workloads 1x32768,8x32768,1x131072 --equal-kv-gib 64 ${COMMIT:+--commit $COMMIT} \
    --deadline-s 230 --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "bench rc $?"
grep -A20 "^| cache" "$OUT/e2e.log"
timeout 50 python3 -m pytest tests/gpu/test_hf_gpu.py -q -x -s -k "calibrated_shape or select_backend_on" \
    > "$OUT/hf_gpu.log" 2>&1
echo "tests rc $?"
tail -5 "$OUT/hf_gpu.log"
