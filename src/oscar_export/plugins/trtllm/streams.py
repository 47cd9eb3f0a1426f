"""The CUDA-stream calls of the TensorRT-LLM adapter, in one place (NOT EXECUTED in TensorRT-LLM).

TensorRT-LLM runs the model forward under ``torch.cuda.stream(execution_stream)``: ``create_py_executor``
(``_torch/pyexecutor/py_executor_creator.py`` @000429d5) creates the stream and hands it to ``KvCacheCreator``,
whose ``KVCacheManager`` keeps it (``resource_manager.py``: ``self._stream = execution_stream``, a stream of its own
when none is given), while the executor calls ``prepare_resources`` / ``free_resources`` on its thread's current
stream. The OSCAR cache's device writes outside the forward (a new request's slot reset, its block-table row,
the batch's slot list, the request-id rows) are therefore ordered with the forward twice over:

* they are issued on the ``execution_stream`` upstream passes to the manager, the stream the forward (and every
  CUDA-graph replay) runs on, so the stream itself orders them;
* the manager records an event after them, and the first layer's eager forward makes its own stream wait on it,
  which orders them whichever stream the forward is on (an upstream without ``execution_stream``, a forward on
  another stream). Before writing, the manager's stream waits on the event the last forward recorded, so a write
  for step N+1 cannot overtake step N's reads under the overlap loop.

:class:`DeviceStreams` is the real implementation (CUDA: ``torch.cuda``; no CUDA: nothing to order). The CPU
replays substitute a simulation with the same three methods (``tests/plugins/trtllm_streams.py``).
"""

from __future__ import annotations

import contextlib


class DeviceStreams:
    """``using`` / ``record`` / ``wait`` on CUDA streams; no-ops where there is no CUDA device."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()

    def using(self, stream):
        """Issue the block's device work on ``stream`` (``None``: the current stream)."""
        import torch

        if stream is None or not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def record(self):
        """An event after the work issued so far on the current stream (``None`` without CUDA)."""
        import torch

        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event) -> None:
        """Make the current stream's later work wait for ``event`` (a no-op for ``None``)."""
        import torch

        if event is not None and self.cuda:
            torch.cuda.current_stream().wait_event(event)


__all__ = ["DeviceStreams"]
