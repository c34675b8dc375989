"""CUDA-only tests, run on a GPU machine: every test here is marked `gpu`."""

from pathlib import Path

import pytest

from tests.support.tiers import EVERY_MODULE, mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, gpu={EVERY_MODULE})
