#!/usr/bin/env bash
# The GPU evaluation protocol on the H200 in consecutive device calls (a call carries at most 64 MiB: the 98 MB GGUF
# travels in two parts, .mA/part then .mB/part, and the machine must stay warm between the calls).
#   call 1 (carry .mA):                 cp .mA/part /root/partA          (plus any other GPU work)
#   call 2 (carry .mB .whl .hqq art):   bash benchmarks/eval_gpu_h200.sh a   # text + NIAH of the fake-quantized methods
#   call 3 (carry .whl .hqq art):       bash benchmarks/eval_gpu_h200.sh b   # deployed (DEP_ARGS), then NIAH of the HF
#                                       QuantizedCache methods (HF=0 skips)
#   or  (carry .whl .hqq art [.evalres]): bash benchmarks/eval_gpu_h200.sh d   # deployed beside the HF NIAH
#   or  (carry .mB .whl [.art27]):      bash benchmarks/eval_gpu_h200.sh g   # issue 27, one call after call 1: the
#                                       # default artifact (.art27, else calibrated here with the default recipe) as
#                                       # deployed (DEP_ARGS), then the default calibration of a random-weight
#                                       # Llama-3-8B shape (time, peak GPU memory); $OUT: results.json/.md, logs.
#                                       # Not yet completed on the H200 (see mode g below)
#   or  (carry .whl .hqq .evalres and the ARTS): ARTS="art_a art_b" bash benchmarks/eval_gpu_h200.sh f
#                                       # the deployed runs (DEP_ARGS) of several artifacts side by side, one GPU;
#                                       # each in /tmp/eval_<artifact>, copied to $OUT/eval_<artifact>
# Results accumulate in $RES (default /tmp/eval_gpu) on the device (eval_gpu.py --phases merges) and are copied to
# $OUT after each; ART (default art) is the artifact directory, e.g. ART=art_k4 RES=/tmp/eval_k4 for a second one.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
RES=${RES:-/tmp/eval_gpu}; ART=${ART:-art}; G=/tmp/smol.gguf
[ -d "$RES" ] || [ ! -d .evalres ] || cp -r .evalres "$RES"  # an earlier session's results (carry .evalres)
[ -f "$G" ] || cat /root/partA .mB/part > "$G" || exit 1
[ -d /tmp/site ] || python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >/dev/null || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/.hqq
ev() { local t=$1; shift; timeout "$t" python3 benchmarks/eval_gpu.py "$G" --artifact "$ART" --out "$RES" "$@" 2>&1 \
       | tee -a "$OUT/eval.log" | tail -n 60; cp -r "$RES" "$OUT/" 2>/dev/null; }
OURS=bf16,int2-naive,quarot-int2,quarot-int2-channel,kivi2,kivi2-matched,oscar-research,oscar
if [ "${1:-}" = a ]; then
    ev 240 --phases text
    ev "${NIAH_S:-330}" --phases niah --methods "$OURS"
elif [ "${1:-}" = b ]; then
    ev "${DEP_S:-300}" --phases deployed ${DEP_ARGS:-}
    [ "${HF:-1}" = 1 ] && ev "${HF_S:-300}" --phases niah --methods bf16,hf-hqq-int2,hf-quanto-int2,hf-hqq-int4,hf-quanto-int4
elif [ "${1:-}" = d ]; then  # deployed runs (background) beside the HF QuantizedCache NIAH (foreground, own out dir)
    ( ev "${DEP_S:-480}" --phases deployed ${DEP_ARGS:-} >/dev/null ) &
    RES=/tmp/eval_gpu_hf ev "${HF_S:-480}" --phases niah --methods "${HF_METHODS:-hf-quanto-int2,hf-hqq-int2,hf-quanto-int4,hf-hqq-int4}"
    wait; tail -n 30 "$OUT/eval.log"
elif [ "${1:-}" = g ]; then
    # One after the other: run side by side (2026-12-02, commit 42408cc) the 8B fit's CPU threads and the SmolLM2
    # calibration's oversubscribed the 16 cores and neither finished in 295 s (the SmolLM2 fit alone needs ~150 CPU s).
    A=(); [ -d .art27 ] && A=(--artifact .art27)
    timeout "${DEP_S:-330}" python3 benchmarks/eval_gpu.py "$G" "${A[@]}" --out "$RES" --phases text,deployed --methods bf16 \
        ${DEP_ARGS:---text-windows 1 --deployed-runs triton} > "$OUT/eval.log" 2>&1
    cp "$RES"/results.json "$RES"/results.md "$OUT"/ 2>/dev/null; [ -d "$RES/artifact" ] && cp -r "$RES/artifact" "$OUT/"
    tail -n 45 "$OUT/eval.log"
    timeout "${CAL_S:-400}" python3 benchmarks/calibrate_time.py --shape llama3-8b --device cuda \
        --json "$OUT/calibrate_8b.json" > "$OUT/calibrate_8b.log" 2>&1; tail -n 30 "$OUT/calibrate_8b.log"
elif [ "${1:-}" = f ]; then
    for a in ${ARTS:?ARTS: the artifact directories}; do
        ( ART=$a RES=/tmp/eval_$a; [ -d "$RES" ] || cp -r .evalres "$RES"
          ev "${DEP_S:-300}" --phases deployed ${DEP_ARGS:-} > "$OUT/deployed_$a.log" ) &
    done
    wait; for a in $ARTS; do echo "=== $a"; grep -A 8 "^NIAH (split" "$OUT/deployed_$a.log" | tail -n 4; done
fi
