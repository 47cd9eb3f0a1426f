"""The artifact already in ``eval --save-artifact``: evaluated instead of calibrating when it fits the model, refused
before the work when it does not, replaced only with ``--force`` (what eval did not write there is kept:
``atomic_dir``)."""

from __future__ import annotations

import os
from pathlib import Path


def saved_artifact(args, inputs) -> object | None:
    """The artifact already in ``--save-artifact`` (read and checked in full), which eval evaluates instead of
    calibrating; None when there is none or ``--force`` replaces it (then ``--save-artifact`` is claimed). Raises
    ``UserError`` for one that cannot be read, and ``out_dir.check_out_dir``'s errors for a folder of other files.
    ``inputs``: the ``(option, path)`` pairs ``--save-artifact`` must stay apart from."""
    from oscar_export.calibration.artifact import META_FILE, load_artifact
    from oscar_export.cli import UserError
    from oscar_export.out_dir import check_inputs, check_out_dir

    save = Path(args.save_artifact)
    check_inputs(save, inputs, "--save-artifact")
    if not args.force and save.is_dir() and os.path.lexists(save / META_FILE):
        try:
            return load_artifact(save)
        except (ValueError, OSError) as e:
            raise UserError(f"--save-artifact {save}: holds an artifact eval cannot use ({e}); pass --artifact, "
                            f"another --save-artifact, or --force to calibrate anew and replace it") from None
    check_out_dir(save, args.force, META_FILE, "--save-artifact", inputs, claim=True)
    return None


def use_saved(args, saved, model):
    """``saved`` (the artifact in ``--save-artifact``) once it is checked against ``model``, said in one line."""
    from oscar_export.cli import UserError

    try:
        saved.check_model(model.config)
    except ValueError as e:
        raise UserError(f"--save-artifact {args.save_artifact}: holds an artifact that does not fit this model ({e}); "
                        f"pass another --save-artifact, or --force to calibrate anew and replace it") from None
    tokens = saved.config.get("tokens", "?")
    print(f"using the artifact already in {args.save_artifact}/ (calibrated on {tokens} tokens, pages "
          f"{saved.bits_per_element():.2f} bits/element); --force calibrates anew and replaces it")
    return saved


__all__ = ["saved_artifact", "use_saved"]
