"""The deployment's startup checks (plugins/trtllm/deployment.py): bundles and checkpoints that do not fit are
refused at startup; the checkpoint's ``oscar`` section is read as ``oscar-export export`` writes it."""

from __future__ import annotations

import json

import pytest

from oscar_export.kernels.layout import KVCacheLayout

from helpers import (
    MIXED_KEY_BITS,
    standins_only,
    trtllm_bundle,
    trtllm_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bad_deployments_fail_at_startup(ns, tmp_path):
    standins_only(ns)
    from oscar_export.kernels.aot.manifest import BundleError
    from oscar_export.plugins.trtllm import register

    ckpt = trtllm_checkpoint(tmp_path / "ckpt")
    other = KVCacheLayout.default(2, 64, sink=16, window=64, page_size=16)
    with pytest.raises(BundleError, match=r"no \['decode_split', .*kernels for this checkpoint's oscar section"):
        register(ckpt, trtllm_bundle(tmp_path / "b1", layout=other), arch="sm_90")
    with pytest.raises(BundleError, match=r"built for \['sm_80'\], this GPU is sm_90"):
        register(ckpt, trtllm_bundle(tmp_path / "b2", archs=("sm_80",)), arch="sm_90")
    with pytest.raises(BundleError, match="compiled for softmax scale"):
        register(ckpt, trtllm_bundle(tmp_path / "b3", scale=0.1), arch="sm_90")
    with pytest.raises(NotImplementedError, match="model family 'qwen2' is not served"):
        register(trtllm_checkpoint(tmp_path / "q", model_type="qwen2"), trtllm_bundle(tmp_path / "b4"), arch="sm_90")
    mixed = trtllm_checkpoint(tmp_path / "k4", key_bits=MIXED_KEY_BITS)
    with pytest.raises(BundleError, match=r"no \['decode_split', .*kernels for this checkpoint's oscar section "
                                          r"\(layout tag .*_k4, 4-bit keys\)"):
        register(mixed, trtllm_bundle(tmp_path / "b5"), arch="sm_90")  # the bundle has the 2-bit kernels only


def test_the_checkpoints_oscar_section_is_read_as_export_writes_it(tmp_path):
    """The deployment reads config.json as ``oscar_export.checkpoint.read_export`` does: an artifact outside the
    checkpoint (``"artifact": "../elsewhere"``), a section of another format version and a repeated key are
    refused."""
    from oscar_export.plugins.trtllm.deployment import OscarDeployment

    ckpt = trtllm_checkpoint(tmp_path / "ckpt")
    bundle = trtllm_bundle(tmp_path / "b")
    OscarDeployment(ckpt, bundle, arch="sm_90")  # as written: loads
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "oscar").rename(tmp_path / "elsewhere")
    (ckpt / "config.json").write_text(json.dumps({**cfg, "oscar": {**cfg["oscar"], "artifact": "../elsewhere"}}))
    with pytest.raises(ValueError, match=r"the artifact '\.\./elsewhere' is outside the checkpoint"):
        OscarDeployment(ckpt, bundle, arch="sm_90")
    (tmp_path / "elsewhere").rename(ckpt / "oscar")
    (ckpt / "config.json").write_text(json.dumps({**cfg, "oscar": {**cfg["oscar"], "format_version": 7}}))
    with pytest.raises(ValueError, match=r"no 'oscar' section of format 1"):
        OscarDeployment(ckpt, bundle, arch="sm_90")
    (ckpt / "config.json").write_text(json.dumps(cfg)[:-1] + ', "oscar": {}}')
    with pytest.raises(ValueError, match=r"duplicate key 'oscar'"):
        OscarDeployment(ckpt, bundle, arch="sm_90")
