"""On two GPUs through Ray (NCCL, the compiled-graph step): PP=2 and TP=2 give TP=1's
greedy tokens. Run on the device: `pytest -m gpu tests/test_parallel_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.test_parallel import write_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

PROMPTS = [[5, 17, 99, 3, 200, 41], [250, 7, 7, 12], list(range(10, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _tokens(path: str, **engine_args) -> list[list[int]]:
    llm = LLM(path, max_model_len=128, gpu_memory_utilization=0.3, **engine_args)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pp2_equals_tp1(tiny, dtype):
    assert _tokens(tiny, dtype=dtype, pipeline_parallel_size=2) == _tokens(tiny, dtype=dtype)


def test_tp2_equals_tp1_in_float32(tiny):
    # float32: bf16 all-reduce sums in another order and may flip a near-tie.
    want = _tokens(tiny, dtype="float32")
    assert _tokens(tiny, dtype="float32", tensor_parallel_size=2) == want
