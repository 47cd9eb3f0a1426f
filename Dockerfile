# OSCAR 2-bit KV cache on TensorRT-LLM 1.2.1 (PyTorch backend; the 1.2 source layout, tensorrt_llm/_torch/
# attention_backend/...: plugins/trtllm/upstream.py also resolves the newer main layout).
#
# UNTESTED: the machines this project was built on have no Docker engine and cannot install TensorRT or
# TensorRT-LLM, so neither this image nor the TensorRT-LLM module it serves was ever built or run. The module's
# contract was tested against stand-ins of TensorRT-LLM's classes (tests/plugins/test_trtllm_contract.py); the
# AOT kernel bundle it compiles was checked on an H200 through the CUDA driver API (tests/gpu/test_aot_gpu.py).
#
#   docker build -t oscar-trtllm .
#   docker run --gpus all -p 8000:8000 -v $PWD/ckpt:/export:ro -v $PWD/deploy:/deploy oscar-trtllm
#
# /export is a checkpoint written by `oscar-export export`; /deploy receives the deployment directory.
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.2.1
FROM ${TRTLLM_IMAGE}

WORKDIR /opt/oscar-export
COPY pyproject.toml README.md ./
COPY oscar_export ./oscar_export
COPY kernels ./kernels
COPY calibration ./calibration
COPY plugins ./plugins

# Keep the image's torch/triton/transformers; add only what the image may lack.
RUN python3 -m pip install --no-cache-dir --no-deps . \
 && python3 -m pip install --no-cache-dir "safetensors>=0.4" "tqdm>=4.60" "cuda-python>=12.0" "onnx>=1.15"

ENV OSCAR_ARCH=sm_90
EXPOSE 8000
# extra_llm_api_options.yaml (written by build) turns off what was not run inside TensorRT-LLM: see its README.md.
CMD ["bash", "-c", "set -e; test -d /deploy/out || oscar-export build --export /export --out /deploy/out --arch ${OSCAR_ARCH}; exec trtllm-serve serve /deploy/out/checkpoint --backend pytorch --custom_module_dirs /deploy/out/trtllm_module --extra_llm_api_options /deploy/out/extra_llm_api_options.yaml --host 0.0.0.0 --port 8000"]
