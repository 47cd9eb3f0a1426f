"""Where TensorRT-LLM keeps the names the adapter uses (plugins/trtllm/upstream.py): the stand-ins reproduce exactly
the upstream signatures recorded in ``trtllm_signatures.json`` (1.2 and main layouts); the real package, where it
imports, has every recorded parameter the adapter relies on."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
SIGNATURES = json.loads((Path(__file__).parent / "trtllm_signatures.json").read_text())["layouts"]


def test_standins_mirror_the_recorded_signatures(ns):
    """Stand-ins: exactly the recorded upstream signatures. The real package (where it imports): every recorded
    parameter the adapter relies on is there."""
    objs = {"AttentionBackend": ns.interface.AttentionBackend, "KVCacheManager": ns.resource_manager.KVCacheManager,
            "get_kv_cache_manager_cls": ns.util.get_kv_cache_manager_cls,
            "register_auto_model": ns.modeling_utils.register_auto_model}
    for path, entry in SIGNATURES[ns.layout]["files"].items():
        for name, want in entry["signatures"].items():
            owner, _, attr = name.partition(".")
            fn = getattr(objs[owner], attr) if attr else objs[owner]
            if want == ["@classmethod"]:  # upstream's Attention.__init__ calls it on the class
                assert isinstance(inspect.getattr_static(objs[owner], attr), classmethod), f"{path}: {name}"
                assert _sig(fn) == [], f"{path}: {name} takes {_sig(fn)}"
            elif getattr(ns, "real", False):
                missing = [p for p in want if p.rstrip("=") not in {x.rstrip("=") for x in _sig(fn)}]
                assert not missing, f"{path}: {name} has no {missing}"
            else:
                assert _sig(fn) == want, f"{path}: {name} stand-in {_sig(fn)} != recorded {want}"


def _sig(fn) -> list[str]:
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        elif p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        else:
            out.append(p.name + ("=" if p.default is not p.empty else ""))
    return out
