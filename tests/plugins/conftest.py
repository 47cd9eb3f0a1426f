"""Fixtures of the TensorRT-LLM adapter tests (test_trtllm_model.py, test_trtllm_cache.py, test_trtllm_attention.py,
test_trtllm_deployment.py, test_trtllm_upstream.py): the stand-ins installed under TensorRT-LLM's real module names,
a registered deployment (fake bundle, reference cache ops). Their shared setup is in tests/helpers.py.

The OSCAR TensorRT-LLM adapter is tested against stand-ins of TensorRT-LLM under its real module names.
Stand-ins (``trtllm_standins/``, whose docstring tables each upstream fact with its file and commit) for the
1.2 and main layouts, with the signatures recorded in ``trtllm_signatures.json``. The model is built by
``AutoModelForCausalLM.from_config`` on a frozen ``ModelConfig``, each layer's ``Attention.forward`` gets the
packed ``q|k|v`` rows before RoPE, ``KvCacheCreator`` runs the estimation / teardown / rebuild, a spawned
worker process unpickles the model-class mapping (``trtllm_worker.py``); executor-loop replays
(``trtllm_driver.py``: plain loop, overlap loop, CUDA-graph warmup/capture/replay with upstream's padding
request) compare the adapter's cache after every step with the reference cache writer. The cache ops are the
reference ones (``plugins/trtllm/reference_ops.py``, same semantics as the AOT kernels, which
tests/gpu/test_trtllm_gpu.py compares with the JIT on an H200). Nothing here ran against TensorRT-LLM itself.

Where TensorRT-LLM itself imports, ``LAYOUTS`` gains ``"real"`` and the registration tests run on it
unchanged (UNTESTED here: it never imports on these machines).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import MIXED_KEY_BITS, TRTLLM_HEADS, trtllm_bundle, trtllm_checkpoint


def _real_trtllm() -> bool:
    try:
        return importlib.util.find_spec("tensorrt_llm") is not None and bool(__import__("tensorrt_llm"))
    except Exception:
        return False


#: the TensorRT-LLM source layouts the stand-ins reproduce, and the real package where it imports.
LAYOUTS = ["1.2", "main"] + (["real"] if _real_trtllm() else [])


@pytest.fixture(scope="module")
def one_thread():
    """The replays are thousands of tiny CPU ops: one intra-op thread is several times faster than many (the
    adapter's test files use it for every test: ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=LAYOUTS)
def ns(request, monkeypatch):
    """The stand-ins of one upstream layout installed under TensorRT-LLM's module names (or the real package)."""
    import trtllm_standins

    if request.param == "real":
        return trtllm_standins.real_namespace()
    return trtllm_standins.install(monkeypatch, request.param)


@pytest.fixture
def deploy(ns, tmp_path):
    """``(ns, deployment)``: a checkpoint and fake bundle registered with the reference cache ops."""
    from oscar_export.plugins.trtllm import register
    from oscar_export.plugins.trtllm.reference_ops import TorchCacheOps

    ckpt, bundle = trtllm_checkpoint(tmp_path / "ckpt"), trtllm_bundle(tmp_path / "kernels")
    dep = register(ckpt, bundle, arch="sm_90", ops_factory=lambda lay: TorchCacheOps(lay, TRTLLM_HEADS, 64 ** -0.5))
    return ns, dep


@pytest.fixture
def deploy_mixed(ns, tmp_path):
    """A checkpoint with 4-bit keys in layer 0 (``key_bits``) and a bundle with both widths' kernels."""
    from oscar_export.plugins.trtllm import register
    from oscar_export.plugins.trtllm.reference_ops import TorchCacheOps

    ckpt = trtllm_checkpoint(tmp_path / "ckpt", key_bits=MIXED_KEY_BITS)
    bundle = trtllm_bundle(tmp_path / "kernels", key_bits=MIXED_KEY_BITS)
    made = []

    def ops(lay):
        made.append(lay)
        return TorchCacheOps(lay, TRTLLM_HEADS, 64 ** -0.5)

    dep = register(ckpt, bundle, arch="sm_90", ops_factory=ops)
    dep.made_ops = made
    return ns, dep
