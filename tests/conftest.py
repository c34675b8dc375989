"""Test-session settings shared by every module, and the fixtures several folders share.

Each folder's conftest.py names its slow tests, left out of the fast lane
`pytest -m "not gpu and not slow"`; tests/support/tiers.py groups the tests for xdist.
"""

import os

import pytest

# Several processes (pytest, Ray replicas) share CI's 2 cores: one intra-op thread each
# avoids the oversubscription that makes small CPU matmuls tens of times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    # Triton kernels then run in Triton's interpreter on CPU tensors (tests/kernels/test_kernels.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` shares the tests out by tests/support/tiers.py's groups."""
    if config.getvalue("dist") == "loadgroup":
        from tests.support.tiers import make_scheduler

        return make_scheduler(config, log)
    return None


@pytest.fixture(scope="session")
def bundled_tokenizer():
    """The bundled model's tokenizer, loaded once per test process; a test that changes it
    changes a copy."""
    from engine.bundled import bundled_model_path
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(bundled_model_path())


@pytest.fixture(scope="session")
def bundled_llm():
    """`LLM()` of the bundled model, built once per test process, for tests that only
    generate with it: no spies, no changed settings, no reset caches. Its prefix cache
    keeps what earlier tests left, as any served engine's does."""
    from engine import LLM

    return LLM()


@pytest.fixture(scope="session")
def hf():
    """(tokenizer, model) of the bundled model in transformers, float32 and in eval mode,
    loaded once per test process: the reference the engine's outputs are held to."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.bundled import bundled_model_path

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return tok, model.eval()
