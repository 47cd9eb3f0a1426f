"""``oscar_export/eval/presets.py``: the presets meet the protocol and the main job's purpose; ``--quick`` with another
preset refused."""

from __future__ import annotations

from oscar_export.eval.presets import PRESETS


def test_presets_meet_the_protocol():
    full = PRESETS["full"]
    assert full.text_lengths == (2048, 4096, 8192) and full.niah_lengths == (1024, 2048, 4096, 8192)
    assert full.needles >= 20 and len(full.hf) == 4


def test_main_job_measures_where_the_method_matters():
    """The README's main job scores 2,048 tokens (most of the cache INT2), >= 10 needles per task and
    length, BF16 and ours (calibrated as `oscar-export calibrate` does) against KIVI-2, the research recipe and
    HF QuantizedCache 2-bit."""
    from oscar_export.calibration.key_bits import DEFAULT_BUDGET, MIN_SEQ_LEN
    from oscar_export.kernels.layout import KVCacheLayout

    main = PRESETS["default"]
    assert min(main.text_lengths) >= 2048 and min(main.niah_lengths) >= 2048 and main.needles >= 10
    lay = KVCacheLayout.default(3, 64)
    _, pages, _ = lay.split(min(main.text_lengths))
    assert pages * lay.page_size > 0.8 * min(main.text_lengths)  # most of the cache INT2
    assert {"bf16", "oscar", "kivi2", "oscar-research", "hf-quanto-int2"} <= set(main.methods)
    assert {"single", "multikey"} <= set(main.tasks)
    cfg = main.calibration_config()
    assert (cfg.key_bits_budget, cfg.seq_len) == (DEFAULT_BUDGET, MIN_SEQ_LEN)
    assert PRESETS["quick"].calibration_config().key_bits_budget is None


def test_quick_with_another_preset_is_refused(capsys):
    from oscar_export.cli import main

    assert main(["eval", "--quick", "--preset", "full"]) == 2
    assert "--quick is --preset quick; it cannot go with --preset full" in capsys.readouterr().err
