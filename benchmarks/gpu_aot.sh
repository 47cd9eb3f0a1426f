#!/usr/bin/env bash
# The AOT bundle and the TensorRT-LLM device path with the query rotation once a step (issue 26 item 4: the bundle's
# decode_append writes the step's fp32 stored-basis queries, its split kernels read them and rotate nothing), and
# the decode kernels' GPU tests touched by the ROTATE_Q path's removal. Run from the repository root on the H200;
# everything goes under $OUT; < 240 s. Not yet run on a GPU.
#
#   OUT=/tmp/k_aot bash benchmarks/gpu_aot.sh
#
# $OUT/env.txt       GPU, versions, commit, each stage's return code and time
# $OUT/bundle.txt    the test bundle (tests/gpu/test_aot_gpu.py's build, sm_90 only, PTX ISA 8.8) compiled here in the
#                    background while the first tests run: what OSCAR_AOT_BUNDLE points the AOT tests at
# $OUT/trtllm.txt    tests/gpu/test_trtllm_gpu.py: AotCacheOps.decode_step (bytes, status, the returned q_s) and
#                    decode equal to the JIT bit for bit; the adapter's attention layer equal to the JIT's, graph replay
# $OUT/aot.txt       tests/gpu/test_aot_gpu.py: every bundle kernel through the driver API (the split kernels on q_s;
#                    the TRT-LLM device ops and a 140-step serving sequence against the reference)
# $OUT/kernels.txt   tests/gpu/test_kernels_gpu.py: the tests whose per-program-rotation comparisons became budget
#                    checks of the once-a-step queries, and the decode step in a CUDA graph
source benchmarks/gpu_env.sh

BUNDLE=$(mktemp -d)/bundle
timeout 100 python3 -c "
import sys
sys.path.insert(0, 'tests/gpu')
from test_aot_gpu import build
build('$BUNDLE', archs=('sm_90',))
" > "$OUT/bundle.txt" 2>&1 &
builder=$!

timeout 80 python3 -m pytest tests/gpu/test_trtllm_gpu.py -q -m gpu -s > "$OUT/trtllm.txt" 2>&1
echo "trtllm rc $? at $((SECONDS - start)) s" >> "$OUT/env.txt"

wait $builder
echo "bundle rc $? at $((SECONDS - start)) s" >> "$OUT/env.txt"
OSCAR_AOT_BUNDLE=$BUNDLE timeout $((165 - (SECONDS - start))) python3 -m pytest tests/gpu/test_aot_gpu.py -q -m gpu -s \
  > "$OUT/aot.txt" 2>&1
echo "aot rc $? at $((SECONDS - start)) s" >> "$OUT/env.txt"

TESTS="head_dim_256_two_groups or gluon_two_groups or decode_step_cuda_graph or gluon_real_shape"
TESTS="$TESTS or gluon_head_dims or fused_merge_equals or 4bit_keys_real_shape"
timeout $((228 - (SECONDS - start))) python3 -m pytest tests/gpu/test_kernels_gpu.py -q -m gpu -s -k "$TESTS" \
  > "$OUT/kernels.txt" 2>&1
echo "kernels rc $? at $((SECONDS - start)) s" >> "$OUT/env.txt"
