"""oscar_export/threads.py: one torch thread while other processes keep every core busy."""

from __future__ import annotations

import torch

from oscar_export import threads


def test_one_thread_while_the_load_reaches_the_cores(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    for load, want in ((0.3, 2), (1.9, 2), (2.0, 1), (9.5, 1)):
        monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
        assert threads.cpu_threads(2) == want, load
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 1)
    assert threads.cpu_threads(1) == 1


def test_run_threads_set_for_the_cpu_only_and_given_back(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.5, 0.0, 0.0))
    before = torch.get_num_threads()
    with threads.cpu_run_threads("cuda") as n:  # a CUDA run keeps torch's count
        assert n == before == torch.get_num_threads()
    with threads.cpu_run_threads("cpu") as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == before
