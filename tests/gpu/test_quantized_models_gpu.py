"""FP8 and AWQ checkpoints on a GPU (Triton, torch._scaled_mm) give the greedy tokens and
prompt logprobs of a float model of the same dequantized weights, both in bfloat16. The
checkpoints are written here from a small random Llama (tests/support/random_checkpoints.py),
so the test needs no bundled model. Run on the device:
`pytest -m gpu tests/gpu/test_quantized_models_gpu.py`.

The three prompts prefill together (24 tokens: above the 16 up to which FP8 keeps 16-bit
activations), so the prefill runs FP8 W8A8 and the decode steps W8A16. Tolerance: as in
test_gguf_gpu.py, logprobs within LOGPROB_ATOL (bfloat16 logits of up to about 30 rounded
each its own way), and FP8_LOGPROB_ATOL for the FP8 cases, whose prefill rounds every
layer's activations to e4m3 (3 mantissa bits; a CPU run of the references moved this random
model's logprobs by up to 0.96); greedy tokens equal until the float model's best token
leads by no more than twice the tolerance (a near-tie, where the runs may part).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.fp8_ref import quantize_fp8
from tests.support.bundled_checkpoints import is_quantized_linear
from tests.support.fp8_quantizers import fp8_checkpoint
from tests.support.quantizers import int4_checkpoint
from tests.support.random_checkpoints import PROMPTS, random_llama_weights, write_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LOGPROB_ATOL = 0.5
FP8_LOGPROB_ATOL = 1.25
NUM_TOKENS = 8
TOP_N = 10
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _at_load(weights):
    """The float checkpoint that quantization="fp8" rounds at load, and its rounding."""
    floats = dict(weights)
    for name, w in weights.items():
        if is_quantized_linear(name):
            q, scale = quantize_fp8(w, per_channel=True)
            floats[name] = q.float() * scale[:, None]
    return weights, None, floats


CASES = {
    "fp8-at-load": (_at_load, "fp8"),
    "ct-channel": (lambda w: fp8_checkpoint(w, "ct-channel"), "auto"),
    "fp8-block": (lambda w: fp8_checkpoint(w, "fp8-block"), "auto"),
}


def _awq(weights):
    tensors, floats = int4_checkpoint(weights, AWQ)
    return tensors, AWQ, floats


CASES["awq-g128"] = (_awq, "auto")


def _outputs(folder: str, quantization: str):
    llm = LLM(
        model=folder,
        quantization=quantization,
        dtype="bfloat16",
        max_model_len=64,
        gpu_memory_utilization=0.3,
    )
    try:
        params = SamplingParams(
            temperature=0,
            max_tokens=NUM_TOKENS,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=TOP_N,
        )
        return llm.engine.config.model.quantization, llm.generate(PROMPTS, params)
    finally:
        llm.engine.shutdown()


def _lead(logprobs) -> float:
    best, second = list(logprobs.top.values())[:2]
    return best - second


@pytest.mark.parametrize("case", CASES)
def test_a_quantized_checkpoint_gives_its_float_models_tokens_on_a_gpu(tmp_path, case):
    make, quantization = CASES[case]
    tensors, config, floats = make(random_llama_weights())
    method, quantized = _outputs(write_llama(tmp_path / "q", tensors, config), quantization)
    assert method == (
        "awq" if case.startswith("awq") else "compressed-tensors" if case == "ct-channel" else "fp8"
    )
    _, reference = _outputs(write_llama(tmp_path / "f", floats), "none")
    atol = LOGPROB_ATOL if case.startswith("awq") else FP8_LOGPROB_ATOL
    for prompt, q, f in zip(PROMPTS, quantized, reference, strict=True):
        for step, (token, want) in enumerate(zip(q.outputs[0].token_ids, f.outputs[0].logprobs)):
            if _lead(want) <= 2 * atol:
                break  # a near-tie: the runs may part here
            assert token == want.token_id, f"{case} {prompt}: step {step}"
        for position, (got, want) in enumerate(zip(q.prompt_logprobs, f.prompt_logprobs)):
            if want is None:
                continue
            assert abs(got.logprob - want.logprob) <= atol, f"{case} {prompt} {position}"
