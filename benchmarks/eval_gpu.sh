#!/usr/bin/env bash
# The accuracy of the embedded real model on one Hopper GPU (H100 or H200: nothing here depends on which), in
# consecutive device calls. The 98 MB GGUF is more than one call may carry (64 MiB): it travels in two parts, and the
# machine must stay warm between the calls (files outside the checkout survive there).
#   call 1 (carry .mA):                 cp .mA/part /root/partA
#   call 2 (carry .mB .whl ART):        ART=.art41 bash benchmarks/eval_gpu.sh deployed
#       ours as deployed (the artifact ART through enable_oscar: BF16 model, Triton kernels, the real cache) against
#       the BF16 model with its plain cache, in three processes side by side on the one GPU (each is bound by its
#       host-side launches): text in TEXT_A windows of 4,096 tokens scored at 2K and 4K, text in TEXT_B windows of
#       8,192 (both cut from the first 16,384 tokens of the report text: none of the dev split's), NIAH single /
#       multi-key / multi-value at NIAH_LENGTHS with NEEDLES per task and length (report split). $OUT: eval.log
#       (the three logs), table.md (benchmarks/deployed_table.py: the one table and the targets), and
#       text4k/, text8k/, niah/ each with results.json and results.md.
#   or  (carry .mB .whl ART):           ART=... bash benchmarks/eval_gpu.sh methods  # every method fake-quantized
#                                       (text 2K-8K, NIAH 1K-8K; the HF methods where hqq / quanto import)
#   or  (carry .mB .whl):               bash benchmarks/eval_gpu.sh cal8b  # the default calibration of a random-weight
#                                       Llama-3-8B shape: time and peak GPU memory ($OUT/calibrate_8b.json)
# CPU=1 G=<gguf> runs the same command lines on the CPU (the dry run of the arguments and the $OUT paths; give toy
# sizes through TEXT_A_LEN, TEXT_B_LEN, NIAH_LENGTHS, NEEDLES, and e.g. EXTRA="--text-chunk 64": arguments every
# benchmarks/eval_gpu.py process gets).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
G=${G:-/tmp/smol.gguf}; RES=${RES:-/tmp/eg}; ART=${ART:-.art41}; LIMIT=${LIMIT:-460}
DEV=(); [ "${CPU:-0}" = 1 ] && DEV=(--device cpu)
if [ "${CPU:-0}" != 1 ]; then
    [ -f "$G" ] || cat /root/partA .mB/part > "$G" || exit 1
    sha256sum "$G"
    [ -d /tmp/site ] || python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >/dev/null || exit 1
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
# one evaluation process: ev <name> <args...>; its log goes to $RES/<name>.log, its results to $RES/<name>/
ev() { local n=$1; shift; rm -rf "${RES:?}/$n"; OMP_NUM_THREADS=4 timeout "$LIMIT" python3 benchmarks/eval_gpu.py "$G" "${DEV[@]}" \
       --out "$RES/$n" "$@" ${EXTRA:-} > "$RES/$n.log" 2>&1; echo "$n: exit $?" >> "$RES/$n.log"; }
mkdir -p "$RES"
if [ "${1:-}" = deployed ]; then
    [ -d "$ART" ] || { echo "ART: $ART is not a directory (carry the calibrated artifact)"; exit 1; }
    ONE=(--artifact "$ART" --phases text,deployed --methods bf16 --deployed-runs triton)
    ev text4k "${ONE[@]}" --deployed-parts text --text-lengths "${TEXT_A_LEN:-2048,4096}" \
        --text-windows "${TEXT_A:-4}" &
    ev text8k "${ONE[@]}" --deployed-parts text --text-lengths "${TEXT_B_LEN:-8192}" --text-windows "${TEXT_B:-2}" &
    ev niah "${ONE[@]}" --deployed-parts niah --text-lengths 1024 --text-windows 1 \
        --niah-lengths "${NIAH_LENGTHS:-1024,2048,4096,8192}" --needles "${NEEDLES:-20}" &
    wait
    for n in text4k text8k niah; do
        mkdir -p "$OUT/$n"; cp "$RES/$n"/results.json "$RES/$n"/results.md "$OUT/$n/" 2>/dev/null
        { echo "=== $n"; cat "$RES/$n.log"; } >> "$OUT/eval.log"
    done
    python3 benchmarks/deployed_table.py "$RES/text4k" "$RES/text8k" "$RES/niah" > "$OUT/table.md"
    grep -h "exit\|FAILED\|Error" "$RES"/*.log; cat "$OUT/table.md"
elif [ "${1:-}" = methods ]; then
    ev all --artifact "$ART" --phases text,niah --no-deployed
    cp "$RES/all"/results.json "$RES/all"/results.md "$RES/all.log" "$OUT/"; tail -n 60 "$RES/all.log"
elif [ "${1:-}" = cal8b ]; then
    timeout "$LIMIT" python3 benchmarks/calibrate_time.py --shape llama3-8b --device cuda \
        --json "$OUT/calibrate_8b.json" > "$OUT/calibrate_8b.log" 2>&1; tail -n 30 "$OUT/calibrate_8b.log"
else
    echo "usage: [ART=dir] bash benchmarks/eval_gpu.sh deployed|methods|cal8b (see the head of this file)"; exit 2
fi
