"""Fixtures of the command-line and output tests (``art_dir`` is defined once, in ``helpers.py``)."""

from __future__ import annotations

import json

import pytest

from helpers import (
    art_dir,  # noqa: F401 - a fixture, found by pytest in this module's names
    tiny_export,
    tiny_model,
)


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model means the checks came too late: fail the test if it happens."""
    import oscar_export.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the checks"))


@pytest.fixture
def model_dir(tmp_path):
    """A model folder of the user's: a checkpoint and an unrelated file."""
    d = tmp_path / "my-model"
    tiny_model().save_pretrained(d)
    (d / "notes.txt").write_text("the user's own notes")
    return d


@pytest.fixture(scope="module")
def exported_ckpt(tmp_path_factory):
    """:func:`helpers.tiny_export` once per test module (needs Triton: build compiles for it)."""
    pytest.importorskip("triton")
    return tiny_export(tmp_path_factory.mktemp("exp") / "ckpt")


@pytest.fixture
def fake_bundle(monkeypatch):
    """The kernel bundle (30 s of compiling) and the project wheel stand in: this is about the checkpoint copy."""
    import oscar_export.build as build_mod
    import oscar_export.kernels.aot.compile as compile_mod

    def bundle(specs, dest, **kw):
        dest.mkdir()
        (dest / "manifest.json").write_text(json.dumps({"kernels": [], "triton_version": "stand-in"}))

    monkeypatch.setattr(compile_mod, "build_bundle", bundle)
    monkeypatch.setattr(build_mod, "project_wheel", lambda dest: None, raising=False)
