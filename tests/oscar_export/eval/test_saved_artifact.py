"""``oscar_export/eval/saved_artifact.py`` through ``oscar-export eval``: the artifact already in ``--save-artifact``
evaluated, refused before the work when it does not fit, replaced only with ``--force`` (the user's files kept).
SmolLM2 and calibration stand in (:func:`stand_ins`)."""

from __future__ import annotations

import json

import pytest

from oscar_export.cli import main
from oscar_export.kernels.layout import KVCacheLayout

from helpers import files, one_line, random_artifact, tiny_model


@pytest.fixture
def stand_ins(monkeypatch):
    """eval without SmolLM2: the model is :func:`helpers.tiny_model`, calibration returns its identity artifact (told
    apart from :func:`helpers.random_artifact` by its config); returns the configs calibration was called with."""
    import oscar_export.calibration.pipeline as pipeline
    import oscar_export.models as models
    from oscar_export.calibration.artifact import OscarArtifact

    model = tiny_model()
    calls = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(pipeline, "calibrate", lambda m, tok, cfg, **k: calls.append(cfg) or OscarArtifact.identity(
        m.config, KVCacheLayout.default(2, 16, sink=4, window=16, page_size=16), tokens=cfg.tokens))
    return calls


def users_artifact(path, model=None):
    """What ``oscar-export calibrate --out path`` leaves (an artifact and the tool's marker), plus the user's notes."""
    from oscar_export.atomic_dir import atomic_dir
    from oscar_export.calibration.artifact import META_FILE

    with atomic_dir(path, looks_like=META_FILE) as tmp:
        random_artifact(model or tiny_model()).save(tmp)
    (path / "NOTES.txt").write_text("n")
    return path


EVAL = ["eval", "--preset", "quick", "--no-text", "--no-niah", "--methods", "bf16,oscar"]


def test_eval_uses_the_artifact_already_in_save_artifact_and_replaces_nothing(tmp_path, capsys, stand_ins):
    """The repro: an artifact made by calibrate in art/ with the user's NOTES.txt; eval without --force evaluates
    that artifact (one line says so) and leaves art/ exactly as it was."""
    art = users_artifact(tmp_path / "art")
    before = files(art)
    assert main([*EVAL, "--out", str(tmp_path / "ev"), "--save-artifact", str(art)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"using the artifact already in {art}/" in out and "--force calibrates anew" in out, out
    assert files(art) == before and stand_ins == [], "nothing calibrated, nothing replaced"
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert res["artifact"]["config"] == {"method": "random-test"} and "calibrate_s" not in res["timings"]


def test_eval_refuses_an_artifact_in_save_artifact_that_does_not_fit_before_the_work(tmp_path, capsys, stand_ins):
    """One for another model, one that cannot be read: one line each, nothing calibrated or written."""
    other = users_artifact(tmp_path / "other", tiny_model(layers=3))
    before = files(other)
    assert main([*EVAL, "--out", str(tmp_path / "ev"), "--save-artifact", str(other)]) == 2
    err = one_line(capsys.readouterr().err, "eval")
    assert f"--save-artifact {other}: holds an artifact that does not fit this model" in err, err
    assert "num_hidden_layers: artifact 3, model 2" in err, err
    broken = users_artifact(tmp_path / "broken")
    (broken / "rotations.safetensors").write_bytes(b"x")
    assert main([*EVAL, "--out", str(tmp_path / "ev"), "--save-artifact", str(broken)]) == 2
    assert "holds an artifact eval cannot use" in one_line(capsys.readouterr().err, "eval")
    assert files(other) == before and stand_ins == [] and not (tmp_path / "ev").exists()


def test_eval_force_calibrates_anew_and_keeps_the_users_files(tmp_path, capsys, stand_ins):
    from oscar_export.calibration.artifact import load_artifact

    art = users_artifact(tmp_path / "art")
    assert main([*EVAL, "--out", str(tmp_path / "ev"), "--save-artifact", str(art), "--force"]) == 0
    err = capsys.readouterr().err
    assert len(stand_ins) == 1 and load_artifact(art).config["method"] == "identity"
    assert (art / "NOTES.txt").read_text() == "n" and f"--save-artifact {art}: kept what oscar-export did not " \
                                                        "write there: NOTES.txt" in err, err
