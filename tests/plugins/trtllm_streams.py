"""Two CUDA streams on the CPU: the order in which TensorRT-LLM's executor issues device work, forced to its worst.

TensorRT-LLM runs the model forward on an ``execution_stream`` (``py_executor_creator.py`` @000429d5) and calls
the resource managers' ``prepare_resources`` / ``free_resources`` on the executor thread's current stream
(``plugins/trtllm/streams.py`` has the facts). On a GPU, work queued on the current stream may run after work
queued later on the execution stream unless an event orders them. :class:`SimulatedStreams` replays that on the
CPU, where every op runs at once, by deciding itself when an op runs:

* an op issued on the *current* stream (``"default"``) that writes a watched tensor (:meth:`watch`: the
  adapter's device state) is queued, not run; an op there that reads a tensor with queued writes runs the queue
  first (one stream stays in order);
* an op issued on any other stream (the forward's, ``"execution"``) runs at once; if it reads a tensor whose
  writes are still queued, it reads the old value -- a *stale read*, logged with the tensor's name;
* ``wait(event)`` runs the queue up to the point ``record()`` marked; ``synchronize()`` runs all of it (the
  executor's per-step host synchronisation).

Ops are intercepted with a ``TorchDispatchMode`` (:meth:`installed`), so the adapter's writes are caught whether
or not they go through its stream calls; ``using`` / ``record`` / ``wait`` are ``DeviceStreams``' methods
(``plugins/trtllm/streams.py``), so the adapter's manager can be given this object in their place.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEFAULT, EXECUTION = "default", "execution"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]
    return out


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@dataclass
class SimulatedStreams:
    """The stream model (see the module doc); ``names`` maps storages to the names stale reads report."""

    current: str = DEFAULT
    queue: list = field(default_factory=list)  # (func, args, kwargs, storages written)
    stale_reads: list = field(default_factory=list)
    names: dict = field(default_factory=dict)
    where: str = ""  # what the driver is doing (named in stale reads)

    # ---- DeviceStreams' methods --------------------------------------------------------------------------
    def using(self, stream):
        return self.stream(stream) if stream is not None else contextlib.nullcontext()

    def record(self):
        return (self.current, len(self.queue)) if self.current == DEFAULT else None

    def wait(self, event) -> None:
        if event is not None and event[0] != self.current:
            self._run(event[1])

    # ---- the driver's side ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stream(self, name: str):
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def synchronize(self) -> None:
        self._run(len(self.queue))

    def watch(self, **tensors) -> None:
        """Name the storages of ``tensors`` (``name=tensor``) for the stale-read log."""
        self.names.update({_storage(t): name for name, t in tensors.items() if isinstance(t, torch.Tensor)})

    @contextlib.contextmanager
    def installed(self):
        with _Mode(self):
            yield
        self.synchronize()

    def pending(self) -> set[int]:
        return {s for *_, written in self.queue for s in written}

    def _run(self, upto: int) -> None:
        todo, self.queue = self.queue[:upto], self.queue[upto:]
        for func, args, kwargs, _ in todo:
            func(*args, **kwargs)


class _Mode(TorchDispatchMode):
    def __init__(self, sim: SimulatedStreams) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        if _is_view(func):
            return func(*args, **kwargs)
        written = _written(func, args, kwargs)
        read = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if sim.current == DEFAULT:
            if any(_storage(t) in sim.names for t in written):
                sim.queue.append((func, args, kwargs, {_storage(t) for t in written}))
                if not func._schema.returns:
                    return None
                return written[0] if len(written) == 1 else tuple(written)
            if read & sim.pending():
                sim.synchronize()
            return func(*args, **kwargs)
        stale = read & sim.pending()
        for s in sorted(stale):
            sim.stale_reads.append(f"{sim.where}: {func.__name__} read {sim.names.get(s, 'an unnamed tensor')} "
                                   "with writes of the default stream still queued")
        return func(*args, **kwargs)
