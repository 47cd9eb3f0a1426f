"""Where each source layout keeps the TensorRT-LLM modules the stand-ins fill, by short name, and the layout
installed now."""

from __future__ import annotations

from typing import Any

MODULES = {
    "1.2": {"interface": "tensorrt_llm._torch.attention_backend.interface",
            "utils": "tensorrt_llm._torch.attention_backend.utils"},
    "main": {"interface": "tensorrt_llm._torch.attention.backends.interface",
             "utils": "tensorrt_llm._torch.attention.backends.utils"},
}
COMMON = {
    "resource_manager": "tensorrt_llm._torch.pyexecutor.resource_manager",
    "util": "tensorrt_llm._torch.pyexecutor._util",
    "scheduler": "tensorrt_llm._torch.pyexecutor.scheduler",
    "llm_request": "tensorrt_llm._torch.pyexecutor.llm_request",
    "cuda_graph_runner": "tensorrt_llm._torch.pyexecutor.cuda_graph_runner",
    "model_config": "tensorrt_llm._torch.model_config",
    "modeling_utils": "tensorrt_llm._torch.models.modeling_utils",
    "modeling_auto": "tensorrt_llm._torch.models.modeling_auto",
    "modeling_llama": "tensorrt_llm._torch.models.modeling_llama",
    "attention_module": "tensorrt_llm._torch.modules.attention",
}

ACTIVE: dict[str, Any] = {}  # the installed layout's backend classes (install())
