"""The tests' shared helpers, each in the module of the folder that uses it, importable here under its own name
(``from helpers import tiny_model``):

* ``helpers_models.py``: tiny random-weight models, transforms, artifacts, tokenizers, a tiny export; the
  boundary-heavy shape grid (every folder);
* ``helpers_triton.py``: Triton kernels where they can run (the interpreted child on the CPU);
* ``helpers_calibration.py``: tests/calibration and tests/oscar_export (artifacts, model families, planted
  attention data);
* ``helpers_kernels.py``: tests/kernels (exact comparisons with the reference, decode inputs and budgets);
* ``helpers_plugins.py``: tests/plugins (the HF cache without a model, the TensorRT-LLM adapter's inputs).
"""

from __future__ import annotations

from helpers_calibration import (  # noqa: F401
    CAPTURE_SHAPE,
    FAMILY_COMMON,
    FAMILY_MOE,
    FAMILY_VOCAB,
    LLAMA3_ROPE,
    PLANTED_SHAPE,
    TINY_FAMILIES,
    ByteTokenizer,
    art_dir,
    artifact_config,
    assert_same_artifact,
    capture_llama,
    config_artifact,
    family_config,
    family_model,
    files,
    identity_artifact_with_stats,
    one_line,
    own_copy,
    planted,
    refused,
    small_artifact,
    small_cfg,
    stats_and_objective,
    tamper,
    written,
)
from helpers_kernels import (  # noqa: F401
    BUFFERS,
    CLIPS,
    LEVELS,
    appends_equal_reference,
    assert_equal,
    assert_quantizes_like_reference,
    attention_errors,
    book_state,
    build_probe_bundle,
    check_attention_budget,
    decode_steps,
    hopper_split_spec,
    hopper_wrapper,
    mma_layout,
    quant_rows,
    ragged_cache,
    random_transform,
)
from helpers_models import (  # noqa: F401
    BOUNDARY_LENGTHS,
    EVAL_LAYOUT,
    GQA_SHAPES,
    HEAD_DIMS,
    HF_MODEL,
    SMALL_LAYOUT,
    CharTokenizer,
    D,
    eval_transform,
    logits,
    random_artifact,
    randomize_biases_and_norms,
    rotated_transform,
    tiny_export,
    tiny_hf_model,
    tiny_llama,
    tiny_model,
)
from helpers_plugins import (  # noqa: F401
    MIXED_KEY_BITS,
    SMALL_WINDOWS,
    TRTLLM_HEADS,
    TRTLLM_LAYERS,
    TRTLLM_LAYOUT,
    TRTLLM_MAX_SEQ,
    attention_oracle,
    executor_driver,
    expected_contents,
    one_layer,
    pretrained_config,
    small_layout,
    standins_only,
    trtllm_bundle,
    trtllm_checkpoint,
    trtllm_model_config,
    window_requests,
)
from helpers_triton import (  # noqa: F401
    INTERPRETED,
    kernel_fixture,
    kernel_module,
)

__all__ = [
    "BOUNDARY_LENGTHS", "BUFFERS", "ByteTokenizer", "CAPTURE_SHAPE", "CLIPS", "CharTokenizer", "D", "EVAL_LAYOUT",
    "FAMILY_COMMON", "FAMILY_MOE", "FAMILY_VOCAB", "GQA_SHAPES", "HEAD_DIMS", "HF_MODEL", "INTERPRETED", "LEVELS",
    "LLAMA3_ROPE", "MIXED_KEY_BITS", "PLANTED_SHAPE", "SMALL_LAYOUT", "SMALL_WINDOWS", "TINY_FAMILIES",
    "TRTLLM_HEADS", "TRTLLM_LAYERS", "TRTLLM_LAYOUT", "TRTLLM_MAX_SEQ", "appends_equal_reference", "art_dir",
    "artifact_config", "assert_equal", "assert_quantizes_like_reference", "assert_same_artifact", "attention_errors",
    "attention_oracle", "book_state", "build_probe_bundle", "capture_llama", "check_attention_budget",
    "config_artifact", "decode_steps", "eval_transform", "executor_driver", "expected_contents", "family_config",
    "family_model", "files", "hopper_split_spec", "hopper_wrapper", "identity_artifact_with_stats", "kernel_fixture",
    "kernel_module", "logits", "mma_layout", "one_layer", "one_line", "own_copy", "planted", "pretrained_config",
    "quant_rows", "ragged_cache", "random_artifact", "random_transform", "randomize_biases_and_norms", "refused",
    "rotated_transform", "small_artifact", "small_cfg", "small_layout", "standins_only", "stats_and_objective",
    "tamper", "tiny_export", "tiny_hf_model", "tiny_llama", "tiny_model", "trtllm_bundle", "trtllm_checkpoint",
    "trtllm_model_config", "window_requests", "written",
]
