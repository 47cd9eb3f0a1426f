"""The exported checkpoint's schema: the ``oscar`` section, the artifact inside the checkpoint, bad checkpoints."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from oscar_export.checkpoint import (  # noqa: E402
    ARTIFACT_DIR,
    OSCAR_SECTION_VERSION,
    artifact_path,
    load_exported_artifact,
    read_config_json,
    read_export,
    write_checkpoint,
)
from oscar_export.export import export_checkpoint  # noqa: E402

from helpers import random_artifact, tiny_model  # noqa: E402


def test_written_section_is_read_back(tmp_path):
    model = tiny_model()
    art = random_artifact(model)
    write_checkpoint(tmp_path, model, None, art, source="tiny")
    assert not hasattr(model.config, "oscar")  # the section is written, not left on the model
    section = read_export(tmp_path)
    assert section["format_version"] == OSCAR_SECTION_VERSION and section["artifact"] == ARTIFACT_DIR
    assert section["layout"] == art.layout.to_dict() and section["key_bits"] == list(art.key_bits)
    assert section["source_model"] == "tiny" and section["values_prerotated"] is True
    from transformers import AutoConfig

    # read against the checkpoint's own config, which says its values are pre-rotated (the original model's is
    # refused: its v_proj / o_proj are not folded)
    loaded = load_exported_artifact(tmp_path, section, AutoConfig.from_pretrained(tmp_path))
    assert all(t.values_prerotated for t in loaded.transforms)


def test_read_export_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_export(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no 'oscar' section"):
        read_export(tmp_path)
    model = tiny_model()
    out = export_checkpoint(model, None, random_artifact(model), tmp_path / "ckpt")
    for f in (out / ARTIFACT_DIR).iterdir():
        f.unlink()
    with pytest.raises(FileNotFoundError, match="artifact oscar_artifact/ is missing"):
        read_export(out)


@pytest.mark.parametrize("rel", ["../elsewhere", "/abs/art", ".", "", 7])
def test_artifact_outside_the_checkpoint_is_refused(tmp_path, rel):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="outside the checkpoint|expected a relative directory name"):
        artifact_path(tmp_path / "ckpt", {"artifact": rel})


def test_a_link_out_of_the_checkpoint_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt" / "art").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="outside the checkpoint"):
        artifact_path(tmp_path / "ckpt", {"artifact": "art"})


def test_an_unfolded_artifact_is_refused(tmp_path):
    model = tiny_model()
    art = random_artifact(model)
    write_checkpoint(tmp_path, model, None, art, source="tiny")
    art.save(tmp_path / "plain")  # not values_prerotated
    with pytest.raises(ValueError, match="not marked values_prerotated"):
        load_exported_artifact(tmp_path, {"artifact": "plain"})


def test_config_json_must_be_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        read_config_json(tmp_path)
