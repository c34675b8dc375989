"""A GGUF file kept quantized on a GPU (its layers through the Triton WOQ kernels) gives
the greedy tokens and prompt logprobs of the same file dequantized at load, both in
bfloat16. The file is written here with random weights in a mix of types
(tests/support/random_gguf.py), so the test needs no bundled model. Run on the device:
`pytest -m gpu tests/gpu/test_gguf_gpu.py`.

Tolerance. Both paths end in bfloat16 logits, whose largest here lie in [16, 32): one
bfloat16 step there is 0.125, and the two paths round the hidden states and the logits
each its own way (the K-quants' scales are also rounded to float16 when kept quantized).
A logprob (a logit less the log-sum-exp, which the largest logit dominates) is held to
LOGPROB_ATOL, four such steps. The greedy tokens must be equal: each step of the
dequantized model must lead the next best token by more than twice LOGPROB_ATOL, so a
difference is no tie.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.quantization.woq import WoqLinearMethod
from tests.support.random_gguf import NUM_TOKENS, PROMPTS, write_random_llama_gguf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LOGPROB_ATOL = 0.5
TOP_N = 20  # the most prompt logprobs the engine returns


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_random_llama_gguf(tmp_path_factory.mktemp("random-gguf") / "random.gguf")


def _outputs(path, quantization: str):
    """The RequestOutputs of PROMPTS: NUM_TOKENS greedy tokens with the top 2 logprobs of
    each, the top TOP_N logprobs at each prompt position."""
    llm = LLM(
        model=str(path),
        quantization=quantization,
        dtype="bfloat16",
        max_model_len=64,
        gpu_memory_utilization=0.3,
    )
    try:
        assert llm.engine.config.model.quantization == quantization
        model = llm.engine.executor.worker.runner.model
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                assert isinstance(module.method, WoqLinearMethod) == (quantization == "gguf")
        params = SamplingParams(
            temperature=0,
            max_tokens=NUM_TOKENS,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=TOP_N,
        )
        return llm.generate(PROMPTS, params)
    finally:
        llm.engine.shutdown()


def _lead(logprobs) -> float:
    """How far the best token leads the next best."""
    best, second = list(logprobs.top.values())[:2]
    return best - second


def test_a_gguf_kept_quantized_gives_the_dequantized_greedy_tokens_and_logprobs(gguf_path):
    quantized, dequantized = _outputs(gguf_path, "gguf"), _outputs(gguf_path, "none")
    for prompt, q, d in zip(PROMPTS, quantized, dequantized, strict=True):
        leads = [_lead(step) for step in d.outputs[0].logprobs]
        assert min(leads) > 2 * LOGPROB_ATOL, f"{prompt}: a greedy step is a near-tie"
        assert q.outputs[0].token_ids == d.outputs[0].token_ids, prompt

        for position, (got, want) in enumerate(
            zip(q.prompt_logprobs, d.prompt_logprobs, strict=True)
        ):
            if want is None:  # the first token: nothing precedes it
                continue
            where = f"{prompt}, position {position}"
            assert abs(got.logprob - want.logprob) <= LOGPROB_ATOL, where
            shared = set(got.top) & set(want.top)
            assert len(shared) >= TOP_N // 2, f"{where}: the top {TOP_N} differ"
            for token in shared:
                assert abs(got.top[token] - want.top[token]) <= LOGPROB_ATOL, where
            if _lead(want) > 2 * LOGPROB_ATOL:
                assert next(iter(got.top)) == next(iter(want.top)), where
