#!/usr/bin/env bash
# The GPU evaluation protocol on the H200 in consecutive device calls (../shared/ENVIRONMENT.md: the 98 MB GGUF
# travels in two parts, .mA/part then .mB/part, and the machine must stay warm between the calls).
#   call 1 (carry .mA):                 cp .mA/part /root/partA          (plus any other GPU work)
#   call 2 (carry .mB .whl .hqq art):   bash benchmarks/eval_gpu_h200.sh a   # text + NIAH of the fake-quantized methods
#   call 3 (carry .whl .hqq art):       bash benchmarks/eval_gpu_h200.sh b   # deployed (DEP_ARGS), then NIAH of the HF
#                                       QuantizedCache methods (HF=0 skips)
# Results accumulate in /tmp/eval_gpu on the device (eval_gpu.py --phases merges) and are copied to $OUT after each.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
RES=/tmp/eval_gpu; G=/tmp/smol.gguf
[ -d "$RES" ] || [ ! -d .evalres ] || cp -r .evalres "$RES"  # an earlier session's results (carry .evalres)
[ -f "$G" ] || cat /root/partA .mB/part > "$G" || exit 1
[ -d /tmp/site ] || python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >/dev/null || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/.hqq
ev() { local t=$1; shift; timeout "$t" python3 benchmarks/eval_gpu.py "$G" --artifact art/ --out "$RES" "$@" 2>&1 \
       | tee -a "$OUT/eval.log" | tail -n 60; cp -r "$RES" "$OUT/" 2>/dev/null; }
OURS=bf16,int2-naive,quarot-int2,quarot-int2-channel,kivi2,kivi2-matched,oscar-research,oscar
if [ "${1:-}" = a ]; then
    ev 240 --phases text
    ev "${NIAH_S:-330}" --phases niah --methods "$OURS"
elif [ "${1:-}" = b ]; then
    ev "${DEP_S:-300}" --phases deployed ${DEP_ARGS:-}
    [ "${HF:-1}" = 1 ] && ev "${HF_S:-300}" --phases niah --methods bf16,hf-hqq-int2,hf-quanto-int2,hf-hqq-int4,hf-quanto-int4
fi
