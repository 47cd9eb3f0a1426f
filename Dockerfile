# OSCAR 2-bit KV cache on TensorRT-LLM 1.2.1 (PyTorch backend; the 1.2 source layout, tensorrt_llm/_torch/
# attention_backend/...: plugins/trtllm/upstream.py also resolves the newer main layout).
#
# UNTESTED: the machines this project was built on have no Docker engine and cannot install TensorRT or
# TensorRT-LLM, so neither this image nor the TensorRT-LLM module it serves was ever built or run. What was run:
# the module against stand-ins of TensorRT-LLM's classes (tests/plugins/test_trtllm_*.py), the deployment
# directory's wheel installed into a fresh virtualenv (tests/plugins/test_trtllm_deploy.py), and the AOT kernel
# bundle through the CUDA driver API on an H200 (tests/gpu/test_aot_gpu.py). docs/deploy.md lists what is unverified.
#
# The build context is a deployment directory written by `oscar-export build` (any machine with this project
# installed from source; no GPU needed); it carries everything the image needs, this project as a wheel included:
#
#   oscar-export build --export ckpt/ --out deploy/ --arch sm_90
#   docker build -t oscar-trtllm -f Dockerfile deploy/
#   docker run --gpus all -p 8000:8000 oscar-trtllm
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.2.1
FROM ${TRTLLM_IMAGE}

COPY . /deploy
# Keep the image's torch/triton/transformers; add this deployment's wheel (wheels/) and what the image may lack.
RUN python3 -m pip install --no-cache-dir --no-deps --no-index --find-links /deploy/wheels oscar-export \
 && python3 -m pip install --no-cache-dir "safetensors>=0.4" "tqdm>=4.60" "cuda-python>=12.6.2"

EXPOSE 8000
# extra_llm_api_options.yaml (written by build) turns off what was not run inside TensorRT-LLM: see its README.md.
CMD ["trtllm-serve", "serve", "/deploy/checkpoint", "--backend", "pytorch", \
     "--custom_module_dirs", "/deploy/trtllm_module", "--extra_llm_api_options", "/deploy/extra_llm_api_options.yaml", \
     "--max_batch_size", "64", "--max_seq_len", "8192", "--host", "0.0.0.0", "--port", "8000"]
