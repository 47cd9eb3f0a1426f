"""The evaluation's presets: which lengths, windows, needles, methods and calibration ``oscar-export eval`` runs.

``PRESETS`` names them (``--preset``); :func:`preset_from_args` applies the command line's overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Preset:
    """Args: text_lengths (scored as prefixes of windows of the longest), text_windows, niah_lengths, needles
    (per task and length), calib_tokens, research_tokens (research-recipe capture), hf (run the HF
    QuantizedCache methods unless named in --methods), text_chunk (deployed runs: tokens per chunk), tasks (NIAH
    tasks), methods (the methods run unless --methods names others; None: every one), recipe (calibration when
    eval calibrates: ``"default"`` = ``oscar-export calibrate``'s defaults, the accurate recipe; ``"2bit"`` = 2-bit
    keys everywhere on 512-token sequences, for presets too small for the default's 2,048-token sequences)."""

    text_lengths: tuple[int, ...]
    text_windows: int
    niah_lengths: tuple[int, ...]
    needles: int
    calib_tokens: int
    research_tokens: int
    hf: tuple[str, ...] = ()
    text_chunk: int = 16
    tasks: tuple[str, ...] = ("single", "multikey", "multivalue")
    methods: tuple[str, ...] | None = None
    recipe: str = "default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "text_lengths", tuple(sorted(int(x) for x in self.text_lengths)))
        object.__setattr__(self, "niah_lengths", tuple(int(x) for x in self.niah_lengths))
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if (not self.text_lengths or self.text_lengths[0] < 2 or self.text_windows < 1 or self.needles < 1
                or self.calib_tokens < 1 or self.research_tokens < 1 or self.text_chunk < 1 or not self.tasks
                or self.recipe not in ("default", "2bit")):
            raise ValueError(f"Preset: invalid sizes {self}")

    def calibration_config(self):
        """The ``CalibrationConfig`` eval calibrates ours with (``recipe``)."""
        from oscar_export.calibration.config import CalibrationConfig
        from oscar_export.calibration.key_bits import DEFAULT_BUDGET, MIN_SEQ_LEN

        if self.recipe == "2bit":
            return CalibrationConfig(tokens=self.calib_tokens)
        return CalibrationConfig(tokens=self.calib_tokens, seq_len=MIN_SEQ_LEN, key_bits_budget=DEFAULT_BUDGET)


HF_ALL = ("hf-hqq-int2", "hf-quanto-int2", "hf-hqq-int4", "hf-quanto-int4")
#: the main job's methods: BF16, ours and the peers a user compares against
MAIN_METHODS = ("bf16", "oscar", "kivi2", "oscar-research", "hf-quanto-int2")
_FULL = Preset((2048, 4096, 8192), 2, (1024, 2048, 4096, 8192), 20, 20_000, 4096, hf=HF_ALL)
PRESETS = {
    # CI: small and fast, a 2-bit calibration on 4,096 tokens
    "quick": Preset((1024,), 1, (1024,), 2, 4096, 1024, recipe="2bit"),
    # The README's main job: where the method matters, 2,048 tokens (the INT2 pages hold 1,664-1,728 of them)
    # for text and needles, 10 needles per task (single, multi-key; multi-value is answered by no method on
    # this 135M model, BF16 included), ours calibrated as `oscar-export calibrate` does, against BF16 and the
    # peers; HQQ re-optimises the whole history at every flush (minutes here): "long"/"full" or --methods.
    "default": Preset((2048,), 1, (2048,), 10, 20_000, 2048, hf=("hf-quanto-int2",), tasks=("single", "multikey"),
                      methods=MAIN_METHODS),
    # The GPU protocol (docs/design.md §5): 2K/4K/8K text, NIAH at 1K-8K with 20 needles per task and length, every
    # method.
    "full": _FULL,
    # The same lengths and needles for the main job's methods only.
    "long": replace(_FULL, hf=("hf-quanto-int2",), methods=MAIN_METHODS),
}


def preset_from_args(args) -> Preset:
    if args.quick and args.preset not in ("default", "quick"):
        raise ValueError(f"--quick is --preset quick; it cannot go with --preset {args.preset}: give one of them")
    preset = PRESETS["quick" if args.quick else args.preset]
    over = {}
    if args.text_lengths:
        over["text_lengths"] = tuple(int(x) for x in args.text_lengths.split(","))
    if args.text_windows is not None:
        over["text_windows"] = args.text_windows
    if args.needles is not None:
        over["needles"] = args.needles
    if args.niah_lengths:
        over["niah_lengths"] = tuple(int(x) for x in args.niah_lengths.split(","))
    return replace(preset, **over) if over else preset


__all__ = ["HF_ALL", "MAIN_METHODS", "PRESETS", "Preset", "preset_from_args"]
