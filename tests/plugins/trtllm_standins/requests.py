"""Requests and scheduling: ``_torch/pyexecutor/llm_request.py``, ``scheduler.py`` and the padding request id of
``cuda_graph_runner.py``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

#: ``cuda_graph_runner.py``: the request id of CUDA-graph padding requests
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1


class LlmRequestState(enum.Enum):
    """The request states the executor and the adapter use (``llm_request.py`` re-exports the bindings' enum)."""

    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 3
    GENERATION_COMPLETE = 5


class LlmRequest:
    def __init__(self, request_id: int, max_new_tokens: int, input_tokens: list[int], sampling_config=None,
                 is_streaming: bool = False, **kwargs) -> None:
        self.py_request_id = request_id
        self.max_new_tokens = max_new_tokens
        self.prompt_len = len(input_tokens)
        self.py_prompt_len = self.prompt_len
        self.orig_prompt_len = self.prompt_len
        self.context_chunk_size = self.prompt_len
        self.context_current_position = 0
        self.is_dummy_request = False
        self.state = LlmRequestState.CONTEXT_INIT

    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == 0

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= self.prompt_len


@dataclass
class ScheduledRequests:
    context_requests: list = field(default_factory=list)
    generation_requests: list = field(default_factory=list)

    def all_requests(self) -> list:
        return list(self.context_requests) + list(self.generation_requests)
