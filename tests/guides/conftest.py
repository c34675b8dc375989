"""The guides' snippets as written (test_guide_snippets.py): those that build an engine of
the bundled model are slow, the rest (flags, refusals made before a model loads) fast."""

from pathlib import Path

import pytest

from tests.support.tiers import mark_folder

# Engines of the bundled model (one offline, one async, for the module).
SLOW = {"test_guide_snippets.py"}
# The snippets that need no engine.
FAST = {
    "test_guide_snippets.py::test_the_batching_keys_as_written_name_what_kvray_uses",
    "test_guide_snippets.py::test_the_server_flags_as_written_reach_the_app_config",
    "test_guide_snippets.py::test_skip_special_tokens_is_a_request_field_not_a_server_flag",
    "test_guide_snippets.py::test_the_client_takes_its_timeout_as_written",
    "test_guide_snippets.py::test_the_grpc_generate_call",
    "test_guide_snippets.py::test_fp8_mixed_precision_is_refused_on_a_cpu_naming_what_to_use",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, slow=SLOW, fast=FAST)
