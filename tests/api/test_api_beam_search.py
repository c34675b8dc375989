"""The completions API's beam search (vLLM's use_beam_search): what it refuses, naming the
field, and what it asks of the engine; then the bundled model through it."""

from __future__ import annotations

import asyncio

import pytest

from engine.api.errors import APIError
from engine.api.protocol import CompletionRequest
from engine.api.serving import OpenAIServing
from tests.support.fakes import ScriptedEngine
from tests.support.fakes import scripted_completion as _completion


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"min_p": 0.1}, "min_p"),
        ({"seed": 1}, "seed"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"logit_bias": {"7": 1}}, "logit_bias"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 1}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"stream": True}, "stream"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 11}, "n"),
        ({"n": 2, "best_of": 11}, "best_of"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(tokenizer, fields, param):
    engine = ScriptedEngine(tokenizer)
    serving = OpenAIServing(engine)
    request = _completion(use_beam_search=True, max_tokens=4, **fields)
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_completion(request))
    assert info.value.status_code == 400 and info.value.param == param
    assert param in info.value.message
    assert engine.calls == []


def test_neutral_sampling_values_pass_and_the_engine_gets_a_beam_search(tokenizer):
    engine = ScriptedEngine(tokenizer)
    serving = OpenAIServing(engine)
    request = _completion(
        use_beam_search=True,
        n=2,
        best_of=3,
        temperature=0,
        top_p=1,
        top_k=-1,
        length_penalty=0.5,
        early_stopping=True,
        max_tokens=3,
    )
    response = asyncio.run(serving.create_completion(request))
    (call,) = engine.calls
    params = call["params"]
    assert params.use_beam_search and params.n == 3
    assert (params.length_penalty, params.early_stopping, params.max_tokens) == (0.5, True, 3)
    assert len(response.choices) == 2  # the best 2 of 3 beams


def test_the_early_stopping_field_takes_true_false_or_never():
    for value in (True, False, "never"):
        assert CompletionRequest(prompt="a", early_stopping=value).early_stopping == value
    with pytest.raises(ValueError, match="early_stopping"):
        CompletionRequest(prompt="a", early_stopping="sometimes")


def test_the_bundled_model_answers_with_its_best_beams(bundled_llm):
    from engine.async_engine import AsyncEngine
    from engine.beam_search import BeamSearchParams

    engine = AsyncEngine.from_engine_args(max_model_len=128, engine_process=False)
    try:
        serving = OpenAIServing(engine)
        request = CompletionRequest(
            prompt="The capital of France is", use_beam_search=True, n=2, best_of=3, max_tokens=5
        )
        response = asyncio.run(serving.create_completion(request))
    finally:
        engine.shutdown()
    (want,) = bundled_llm.beam_search(
        "The capital of France is", BeamSearchParams(beam_width=3, max_tokens=5)
    )
    texts = [c.text for c in response.choices]
    tok = bundled_llm.get_tokenizer()
    assert texts == [
        tok.decode(s.output_token_ids[:-1] if s.finish_reason == "stop" else s.output_token_ids)
        for s in want.sequences[:2]
    ]
    assert [c.index for c in response.choices] == [0, 1]
