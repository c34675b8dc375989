"""Tests of single modules: no model of the bundled size and no Ray."""

from pathlib import Path

import pytest

from tests.support.tiers import mark_folder

# It starts an engine process of the bundled model.
SLOW = {"test_hop_trace.py::test_an_in_process_request_is_traced_through_its_engine_process"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, slow=SLOW)
