"""An executor worker in its own process, as TensorRT-LLM starts one (``executor/proxy.py`` -> ``worker_main``).

:func:`worker_main` is the target of a ``multiprocessing`` *spawn* process: a fresh interpreter that gets the
parent's ``sys.path`` (as ``MpiPoolSession`` passes ``path=sys.path`` to ``MPIPoolExecutor``) and nothing else. It
installs the stand-in TensorRT-LLM modules, unpickles the ``MODEL_CLASS_MAPPING`` the parent sent -- which
imports the deployment's ``trtllm_module`` by name, so the OSCAR registration and cache-manager substitution run
in this process -- merges it (``MODEL_CLASS_MAPPING.update``), then starts the model the way
``create_py_executor`` does (``from_config``, the KV-cache estimation, the rebuild) and serves a few requests,
checked against the reference. The result (or the traceback) goes back through a queue.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from types import SimpleNamespace


def worker_main(layout: str, mapping_blob: bytes, queue) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        import trtllm_standins
        from trtllm_driver import Driver, Req

        ns = trtllm_standins.install_globally(layout)
        # no GPU here: the reference cache ops in place of the bundle's (the only substitution)
        from oscar_export.plugins.trtllm import deployment
        from oscar_export.plugins.trtllm.reference_ops import TorchCacheOps

        deployment.OscarDeployment.ops = lambda self, lay: TorchCacheOps(lay, self.num_heads, self.sm_scale)
        imported_before = "trtllm_module" in sys.modules
        mapping = pickle.loads(mapping_blob)  # imports the class's module by name
        ns.modeling_auto.MODEL_CLASS_MAPPING.update(**mapping)
        dep = sys.modules["trtllm_module"].deployment
        pretrained = SimpleNamespace(**{k: v for k, v in dep.config.items() if k != "oscar"})
        d = Driver(ns, dep, 2, 128, pretrained, estimate=True)
        reqs = [Req(1, 20, 12), Req(2, 40, 8)]
        d.run_plain(reqs)
        queue.put({"ok": True, "pid": os.getpid(), "imported_before": imported_before,
                   "manager": type(d.mgr).__name__, "estimated": d.estimated,
                   "registered": sorted(ns.modeling_utils.MODEL_CLASS_MAPPING), "checked": d.checked_outputs,
                   "done": all(r.done for r in reqs)})
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        queue.put({"ok": False, "error": traceback.format_exc()})
