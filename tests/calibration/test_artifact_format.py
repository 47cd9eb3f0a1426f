"""``calibration/artifact_format.py``: the bounds a reader checks and the error types."""

from __future__ import annotations

import pytest
import torch

from oscar_export.calibration.artifact import load_artifact
from oscar_export.calibration.artifact_format import LIMITS, ArtifactError


def test_limits_keep_fp16_params_finite():
    """The stated derivation: a row within ``LIMITS.row_abs`` maps to stored values inside the fp16 range."""
    worst = LIMITS.row_abs * LIMITS.scale_max + LIMITS.mean_abs_max
    assert worst * 2 / 3 < LIMITS.fp16_max and worst < LIMITS.fp16_max  # |lo| and (hi - lo) / 3
    assert torch.isfinite(torch.tensor([worst, 2 * worst / 3], dtype=torch.float16)).all()


def test_missing_file_is_both_artifact_error_and_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_artifact(tmp_path)
    assert isinstance(e.value, ArtifactError)
