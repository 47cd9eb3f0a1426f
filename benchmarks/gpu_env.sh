# Sourced by the benchmarks/gpu_*.sh scripts (run from the repository root on the GPU machine): checks $OUT, installs
# the working tree editable, writes $OUT/env.txt (GPU, versions, commit, date, install time) and sets $start, the
# script's clock, for the stage lines the scripts append to env.txt.
set -u
OUT=${OUT:?set OUT to the output folder}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.txt" 2>&1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
  echo "git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  date -u
  echo "install: $((SECONDS - start)) s"
} > "$OUT/env.txt" 2>&1
