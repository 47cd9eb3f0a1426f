"""Issue 31: the artifact loader reads what it checked, and only artifacts that mean one thing.

A link flipped between an inside and an outside file while an artifact loads; a repeated key in ``oscar.json``;
a path the loader cannot open (not "missing"); a codebook whose levels collapse onto each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from oscar_export.calibration.artifact import ArtifactError, ArtifactMissing, load_artifact


def _edit_meta(d: Path, text: str) -> None:
    (d / "oscar.json").write_text(text)


def test_duplicate_keys_are_refused(art_dir):
    """Issue: duplicate keys in oscar.json were accepted (the last one won)."""
    text = (art_dir / "oscar.json").read_text()
    assert text.count('"values_prerotated": false') == 1
    _edit_meta(art_dir, text.replace('"values_prerotated": false', '"values_prerotated": true, '
                                                                   '"values_prerotated": false', 1))
    with pytest.raises(ArtifactError, match="duplicate key 'values_prerotated' in one object"):
        load_artifact(art_dir)


def test_a_path_that_cannot_be_opened_is_not_called_missing(tmp_path):
    """Issue: an unreadable artifact folder or a too-long path was reported as "oscar.json is missing"."""
    with pytest.raises(ArtifactError, match="cannot be opened: File name too long"):
        load_artifact(tmp_path / ("x" * 300))
    with pytest.raises(ArtifactError, match="cannot be opened: Not a directory"):
        (tmp_path / "file").write_text("x")
        load_artifact(tmp_path / "file")
    with pytest.raises(ArtifactMissing, match="oscar.json is missing"):
        load_artifact(tmp_path / "nothing-here")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a folder without read permission")
def test_an_unreadable_folder_is_not_called_missing(art_dir):
    art_dir.chmod(0)
    try:
        with pytest.raises(ArtifactError, match="cannot be opened: Permission denied"):
            load_artifact(art_dir)
    finally:
        art_dir.chmod(0o755)


FLIP = """
import os, sys
from pathlib import Path
d, outside = Path(sys.argv[1]), sys.argv[2]
n = 0
while True:
    tmp = d / f".flip{n % 2}"
    os.symlink(outside if n % 2 else "inside.json", tmp)
    os.replace(tmp, d / "oscar.json")
    n += 1
"""


def test_a_link_flipped_during_loads_is_never_read_from_outside(art_dir, tmp_path):
    """Issue: a symlink flipped between an inside and an outside file was read from outside in 55 of 300 loads."""
    meta = json.loads((art_dir / "oscar.json").read_text())
    inside = art_dir / "inside.json"
    inside.write_text(json.dumps({**meta, "config": {"where": "inside"}}))
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({**meta, "config": {"where": "outside"}}))
    (art_dir / "oscar.json").unlink()
    (art_dir / "oscar.json").symlink_to("inside.json")
    flipper = subprocess.Popen([sys.executable, "-c", FLIP, str(art_dir), str(outside)])  # truly in parallel
    seen = {"inside": 0, "refused": 0}
    try:
        # On a loaded machine the flipper's interpreter can start after 100 loads have finished (CI saw
        # 100 inside, 0 refused): wait until it has flipped once, then load until both outcomes were met.
        deadline = time.monotonic() + 60
        while os.readlink(art_dir / "oscar.json") != str(outside):
            assert flipper.poll() is None and time.monotonic() < deadline, "the flipper never flipped the link"
        loads = 0
        while loads < 100 or min(seen.values()) == 0:  # the old check-then-open read from outside in 1 load of 5
            assert time.monotonic() < deadline, seen
            loads += 1
            try:
                art = load_artifact(art_dir)
            except ArtifactError as e:
                assert "a symbolic link leaving the artifact directory" in str(e), e
                seen["refused"] += 1
            except ArtifactMissing:  # between the unlink and the link of a replace (no replace is atomic here)
                continue
            else:
                assert art.config == {"where": "inside"}, "read from outside the artifact"
                seen["inside"] += 1
    finally:
        flipper.kill()
        flipper.wait()
    assert seen["inside"] > 0 and seen["refused"] > 0, seen


def test_codebook_levels_must_be_spaced(art_dir):
    """Issue: levels [0, 1e-30, 2e-30, 3] passed validation and served at KL 5.4."""
    from oscar_export.calibration.artifact import OscarArtifact

    art = load_artifact(art_dir)
    layout = replace(art.layout, key=replace(art.layout.key, codebook=True))
    bad = torch.tensor([0.0, 1e-30, 2e-30, 3.0]).expand_as(art.transforms[0].k_levels).clone()
    ok = torch.tensor([0.0, 0.9, 2.1, 3.0]).expand_as(bad).clone()
    good = OscarArtifact(layout, tuple(replace(t, k_levels=ok) for t in art.transforms), art.fingerprint, {}, {})
    good.save(art_dir.parent / "good")
    load_artifact(art_dir.parent / "good")
    with pytest.raises(ArtifactError, match=r"k_levels: levels .* are 1e-30 apart; expected at least 0.05"):
        OscarArtifact(layout, tuple(replace(t, k_levels=bad) for t in art.transforms), art.fingerprint, {}, {})
