"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' own logits."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.prompts import LONG_TEXT

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    # Over 700 positions: its logits are computed in slices (341 rows for this vocabulary).
    LONG_TEXT + "\nSummarize the records above in one sentence:",
]
TOP = 3


@pytest.fixture(scope="module")
def reference(hf) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt ids, transformers' log-softmax at each prompt position) per prompt."""
    tok, model = hf
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=False).input_ids
        with torch.inference_mode():
            logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        out.append((ids, logprobs))
    return out


def _check(prompt_logprobs, ids: list[int], ref: torch.Tensor, top: int) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entry, row = prompt_logprobs[p], ref[p - 1]
        assert entry.token_id == ids[p]
        assert entry.logprob == pytest.approx(row[ids[p]].item(), abs=2e-3), f"position {p}"
        assert len(entry.top) == top
        best = row.topk(2)
        if top and best.values[0] - best.values[1] > 1e-3:  # not a near tie
            assert next(iter(entry.top)) == best.indices[0].item()
            if entry.rank == 1:
                assert entry.logprob == pytest.approx(best.values[0].item(), abs=2e-3)


def test_prompt_logprobs_match_transformers(reference, bundled_llm):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    outputs = bundled_llm.generate(PROMPTS, params)
    for out, (ids, ref) in zip(outputs, reference, strict=True):
        assert out.prompt_token_ids == ids
        _check(out.prompt_logprobs, ids, ref, TOP)
        want_rank = [int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1 for p in range(1, len(ids))]
        got_rank = [e.rank for e in out.prompt_logprobs[1:]]
        # Ranks agree wherever neighbouring logprobs are not within rounding of each other.
        assert sum(g == w for g, w in zip(got_rank, want_rank)) >= 0.98 * len(want_rank)


def test_only_the_requests_that_ask_get_prompt_logprobs(reference, bundled_llm):
    asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm = bundled_llm
    outputs = llm.generate(PROMPTS[:2], [asked, plain])
    ids, ref = reference[0]
    _check(outputs[0].prompt_logprobs, ids, ref, top=0)
    assert outputs[1].prompt_logprobs is None


def test_chunked_prefill_and_preemption_keep_prompt_logprobs(reference):
    params = SamplingParams(temperature=0.0, max_tokens=48, prompt_logprobs=1, ignore_eos=True)
    # 32 tokens a step: every prompt is computed over several steps.
    outputs = LLM(max_num_batched_tokens=32, max_num_seqs=4).generate(PROMPTS, params)
    for out, (ids, ref) in zip(outputs, reference, strict=True):
        _check(out.prompt_logprobs, ids, ref, top=1)
    # Too few blocks for all three at once: some are preempted and compute their prompt again.
    llm = LLM(num_gpu_blocks=52, enable_prefix_caching=False)
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.stats()["num_preemptions"] > 0
    for out, (ids, ref) in zip(outputs, reference, strict=True):
        _check(out.prompt_logprobs, ids, ref, top=1)


def test_a_cached_prompt_is_computed_again_for_its_logprobs(reference, bundled_llm):
    llm = bundled_llm
    assert llm.engine.config.cache_config.enable_prefix_caching
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(PROMPTS[2:], greedy)
    (out,) = llm.generate(
        PROMPTS[2:], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    )
    assert out.num_cached_tokens == 0
    ids, ref = reference[2]
    _check(out.prompt_logprobs, ids, ref, top=0)
    # Its blocks are cached as usual for requests that do not ask.
    (again,) = llm.generate(PROMPTS[2:], greedy)
    assert again.num_cached_tokens > 500


def test_n_samples_share_one_prompt_logprobs_list(reference, bundled_llm):
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4, prompt_logprobs=2)
    (out,) = bundled_llm.generate(PROMPTS[:1], params)
    assert len(out.outputs) == 2
    ids, ref = reference[0]
    _check(out.prompt_logprobs, ids, ref, top=2)


@pytest.mark.parametrize("value", [-1, 21, 1.5, "3"])
def test_prompt_logprobs_out_of_range_is_named(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


@pytest.mark.parametrize("engine_process", [False, True])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(reference, engine_process):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, one token."""
    import asyncio

    from engine.api.protocol import CompletionRequest
    from engine.api.serving import OpenAIServing
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_engine_args(engine_process=engine_process)
    try:
        serving = OpenAIServing(engine)
        request = CompletionRequest(
            model=engine.model_name, prompt=PROMPTS[0], max_tokens=1, echo=True, logprobs=1,
            temperature=0.0,
        )  # fmt: skip
        response = asyncio.run(serving.create_completion(request))
    finally:
        engine.shutdown()
    ids, ref = reference[0]
    (choice,) = response.choices
    assert choice.text.startswith(PROMPTS[0])
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1 == len(logprobs.token_logprobs)
    assert "".join(logprobs.tokens[: len(ids)]) == PROMPTS[0]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert logprobs.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=2e-3)
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 1
