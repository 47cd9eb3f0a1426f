"""Floor 2: activation capture, covariances, rotations, clip fitting and the artifact (docs/design.md §4).

The artifact type is what the rest of the project reads:
``from oscar_export.calibration.artifact import OscarArtifact, load_artifact``.
"""

from .artifact import OscarArtifact, load_artifact, model_fingerprint

__all__ = ["OscarArtifact", "load_artifact", "model_fingerprint"]
