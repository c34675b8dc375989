"""The engine end to end on CPU: models, loader, sampler, scheduler in a step, the offline
and async APIs, and actor groups through Ray."""

from pathlib import Path

import pytest

from tests.support.tiers import mark_folder

# Modules that start a local Ray: the Ray xdist worker runs them, beside tests/serve's.
RAY = {"test_parallel.py"}
# Engines of the bundled model, transformers' reference of it, engine processes.
SLOW = RAY | {
    "test_async_engine.py",
    "test_llm_e2e.py",
    "test_piecewise_graphs.py",
    "test_prompt_logprobs.py",
    "test_structured_output.py",
    "test_tool_choice_engine.py",
    "test_generation_config.py::test_an_engine_process_reports_the_defaults",
    "test_loader.py::test_smollm2_shape_matches_the_bundled_config",
    "test_loader.py::test_bundled_gguf_weights_equal_transformers",
    "test_loader.py::test_bundled_gguf_logits_match_transformers",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, slow=SLOW, ray=RAY)
