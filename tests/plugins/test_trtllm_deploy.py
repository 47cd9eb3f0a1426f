"""The deployment directory installs: `oscar-export build` ships a wheel of this project (``wheels/``), the
deploy README's ``pip install`` puts it into a fresh virtualenv, and the deployment's ``trtllm_module`` then
registers the OSCAR model from the installed package (TensorRT-LLM itself: the stand-ins, not installed here).
The ``Dockerfile`` installs the same wheel with the same command from the deployment it is built from."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """``oscar-export build`` of a tiny exported Llama, its kernel bundle written by ``fake_bundle`` (compiling
    it is tests/oscar_export/test_build.py's; nothing here launches a kernel)."""
    import oscar_export.kernels.aot.compile as compile_mod
    from oscar_export.build import build_deployment
    from oscar_export.calibration.artifact import OscarArtifact, model_fingerprint
    from oscar_export.export import export_checkpoint
    from oscar_export.kernels.layout import KVCacheLayout
    from oscar_export.kernels.transform import LayerTransform

    from fake_bundle import fake_bundle

    root = tmp_path_factory.mktemp("deploy")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    layout = KVCacheLayout.default(1, 64)
    art = OscarArtifact(layout, (LayerTransform.identity(1, 64),), model_fingerprint(cfg), {}, {})
    ckpt = export_checkpoint(transformers.LlamaForCausalLM(cfg).eval(), None, art, root / "ckpt")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compile_mod, "build_bundle", lambda specs, out, archs, **kw: fake_bundle(out, specs, archs=archs))
        return build_deployment(ckpt, root / "out", ["sm_90"])


def _readme_pip(deploy: Path) -> list[str]:
    line = next(x for x in (deploy / "README.md").read_text().splitlines() if x.startswith("pip install"))
    return shlex.split(line.split("#")[0])


def test_deploy_folder_ships_a_wheel_of_this_project(deployment):
    import zipfile

    wheels = sorted((deployment / "wheels").glob("*.whl"))
    assert [w.name for w in wheels] == json.loads((deployment / "deploy.json").read_text())["wheel"]
    (wheel,) = wheels
    names = set(zipfile.ZipFile(wheel).namelist())
    for mod in ("model", "attention", "cache", "deployment", "device", "upstream"):
        assert f"oscar_export/plugins/trtllm/{mod}.py" in names
    for inside in ("oscar_export/plugins/trtllm/model.py", "oscar_export/kernels/pages.py",
                   "oscar_export/calibration/artifact.py"):  # as in the source now
        assert zipfile.ZipFile(wheel).read(inside) == (REPO / "src" / inside).read_bytes(), inside
    assert _readme_pip(deployment) == ["pip", "install", "--no-deps", "--no-index", "--find-links", "./wheels",
                                       "oscar-export"]


@pytest.mark.slow  # ~10 s CPU (a virtualenv, pip, a fresh interpreter)
@pytest.mark.representative
def test_deploy_folder_installs_into_a_fresh_virtualenv(deployment, tmp_path):
    """The README's pip command in a new virtualenv (this machine's torch etc. visible through
    --system-site-packages; ``--ignore-installed`` only because this environment has the project installed from
    source already), then the deployment's trtllm_module imported there: oscar_export comes from the venv."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = _readme_pip(deployment)
    done = subprocess.run([py, "-m", *pip, "--ignore-installed", "-q"], cwd=deployment, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import trtllm_standins\n"
        "ns = trtllm_standins.install_globally('1.2')\n"
        f"sys.path.insert(0, {str(deployment)!r})\n"
        "import trtllm_module, oscar_export, oscar_export.plugins.trtllm.model as m\n"
        "print(json.dumps({'package': oscar_export.__file__, 'model': m.__file__,\n"
        "                  'registered': sorted(ns.modeling_utils.MODEL_CLASS_MAPPING),\n"
        "                  'module': trtllm_module.deployment.model_cls.__module__}))\n"
    )
    run = subprocess.run([py, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    res = json.loads(run.stdout.strip().splitlines()[-1])
    site = str(venv / "lib")
    assert res["package"].startswith(site) and res["model"].startswith(site), res
    assert res["registered"] == ["OscarLlamaForCausalLM"] and res["module"] == "trtllm_module"


def test_dockerfile_installs_the_deployments_wheel():
    """The image is built from a deployment directory and installs its wheel with the README's command; no
    source of this project goes into it, and nothing it installs comes from outside PyPI."""
    text = (REPO / "Dockerfile").read_text()
    assert "COPY . /deploy" in text
    assert "pip install --no-cache-dir --no-deps --no-index --find-links /deploy/wheels oscar-export" in text
    assert "COPY oscar_export" not in text and "pip install --no-deps oscar-export" not in text
    assert "/deploy/trtllm_module" in text and "/deploy/extra_llm_api_options.yaml" in text


def test_build_without_a_source_tree_refused_before_compiling(deployment, tmp_path, monkeypatch):
    """`oscar-export build` run from an installed (not source) package cannot build the wheel: one clear error
    before the bundle compiles, nothing written."""
    import oscar_export.build as build_mod
    import oscar_export.kernels.aot.compile as compile_mod

    monkeypatch.setattr(compile_mod, "build_bundle", lambda *a, **k: pytest.fail("bundle compiled before the check"))
    monkeypatch.setattr(build_mod, "__file__", str(tmp_path / "site-packages" / "oscar_export" / "build.py"))
    with pytest.raises(RuntimeError, match="holds no oscar-export source tree \\(install the project from its "
                                           "source: pip install -e <source>\\)"):
        build_mod.build_deployment(deployment.parent / "ckpt", tmp_path / "out", ["sm_90"])
    assert not (tmp_path / "out").exists()
