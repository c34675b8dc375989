"""The API layer's tests: OpenAIServing over fakes (tests/support/fakes.py) and over small
real engines."""

from pathlib import Path

import pytest

from tests.support.tiers import mark_folder

# Tests that build an engine of the bundled model.
SLOW = {
    "test_api_bad_values.py",
    "test_api_beam_search.py::test_the_bundled_model_answers_with_its_best_beams",
    "test_api_reasoning.py::test_the_bundled_models_grammar_waits_for_the_end_of_its_thought",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, slow=SLOW)


@pytest.fixture(scope="session")
def tokenizer(bundled_tokenizer):
    """The bundled model's tokenizer (tests/conftest.py); a test that changes it changes a
    copy."""
    return bundled_tokenizer
