"""Shared fixtures (the boundary-heavy shape grid is in ``helpers.py``: a name every test file imports alike)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded once per test session."""
    pytest.importorskip("gguf")
    from oscar_export.models import cached_default_model

    try:
        return cached_default_model()
    except ImportError as e:
        pytest.skip(str(e))


#: Slow tests CI runs anyway (README's test command selects `not slow or representative`): one per part of the
#: pipeline, chosen for what only they check. The rest of the slow tests run by hand (`pytest -m slow`).
REPRESENTATIVE_SLOW = {
    "tests/kernels/test_reference.py::test_compiled_decode_attention_equals_eager",
    "tests/kernels/test_aot_bundle.py::test_serving_bundle_compiles_for_every_target",
    "tests/oscar_export/test_cli.py::test_wheel_contains_the_mapped_subpackages",
    "tests/oscar_export/test_export_smollm2.py::test_exported_checkpoint_matches_original_with_plain_cache",
    "tests/plugins/test_hf_models.py::test_1500_tokens_with_small_windows",
    "tests/plugins/test_hf_smollm2.py::test_int2_history_beats_same_scale_noise",
    "tests/plugins/test_hf_smollm2.py::test_ragged_batch_equals_each_alone",
    "tests/plugins/test_trtllm_deploy.py::test_deploy_folder_installs_into_a_fresh_virtualenv",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "representative: a slow test CI runs (see REPRESENTATIVE_SLOW)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in REPRESENTATIVE_SLOW:
            item.add_marker(pytest.mark.representative)

