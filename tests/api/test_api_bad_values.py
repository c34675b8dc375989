"""Every request field, given values of the wrong type, sign or size, through the real
engine: each request is answered (a 4xx naming a problem, or served), never a 5xx or an
exception, and the engine keeps serving. The lists of fields come from the request models,
so a field added later is covered without being named here. Then problems the fuzzing
found, each with its exact message and `param`."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from engine.api.errors import APIError, validation_error
from engine.api.protocol import ChatCompletionRequest, CompletionRequest
from engine.api.serving import OpenAIServing, RequestContext
from engine.async_engine import AsyncEngine
from engine.sampling_params import RequestInputError, SamplingParams

# JSON texts, not Python values: NaN, Infinity and integers past 64 bits reach the parser.
BAD_VALUES = [
    "null", "-1", "0", "2147483648", "9223372036854775808", "1e308", "-1e308", "-0.5",
    "NaN", "Infinity", "true", '""', '"x"', "[]", "{}", "[-1]", "[99999999]", "[[]]",
    '{"99999999": 5}', '{"1": NaN}', '"' + "a" * 3000 + '"',
]  # fmt: skip
BASES = {
    "completion": (CompletionRequest, {"prompt": "Hi", "max_tokens": 1}),
    "chat": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
}  # fmt: skip


@pytest.fixture(scope="module")
def served():
    engine = AsyncEngine.from_engine_args(max_model_len=128, max_num_seqs=8, engine_process=False)
    yield OpenAIServing(engine), engine
    engine.shutdown()


def _bodies(kind: str) -> list[str]:
    model, base = BASES[kind]
    bodies = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        rest = json.dumps({k: v for k, v in base.items() if k != key})
        for value in BAD_VALUES:
            bodies.append(f'{rest[:-1]}, "{key}": {value}}}')
    return bodies


async def _answer(serving: OpenAIServing, kind: str, body: str) -> int:
    model, _ = BASES[kind]
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        return validation_error(e).status_code
    create = serving.create_completion if kind == "completion" else serving.create_chat_completion
    try:
        response = await asyncio.wait_for(create(request, RequestContext()), 30)
        if hasattr(response, "events"):
            text = "".join([event async for event in response.events])
            assert '"error"' not in text, f"{body[:200]}: {text[-300:]}"
    except APIError as e:
        return e.status_code
    return 200


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_no_field_value_breaks_a_request_or_the_engine(served, kind):
    serving, engine = served

    async def run() -> dict[str, int]:
        return {body: await _answer(serving, kind, body) for body in _bodies(kind)}

    statuses = asyncio.run(run())
    server_errors = {body[:200]: s for body, s in statuses.items() if s >= 500}
    assert not server_errors
    refused = sum(400 <= s < 500 for s in statuses.values())
    assert refused > len(statuses) // 2, "most of these values are wrong for their field"
    assert engine.is_healthy

    async def four_tokens() -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outputs = [o async for o in engine.generate("The capital of France is", params, "after")]
        return outputs[-1].outputs[0].token_ids

    assert len(asyncio.run(four_tokens())) == 4


def _error(serving: OpenAIServing, kind: str, fields: dict) -> APIError:
    """The APIError a request of `kind` with `fields` (over its base body) gets."""
    model, base = BASES[kind]
    request = model.model_validate({**base, **fields})
    create = serving.create_completion if kind == "completion" else serving.create_chat_completion
    with pytest.raises(APIError) as raised:
        asyncio.run(create(request, RequestContext()))
    assert raised.value.status_code == 400
    return raised.value


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"presence_penalty": 2.0000001}, "presence_penalty", "in [-2, 2], got 2.0000001"),
        ({"top_p": 1.0000001}, "top_p", "in (0, 1], got 1.0000001"),
        ({"logit_bias": {"5": 100.0000001}}, "logit_bias", "got 100.0000001 for token 5"),
    ],
)
def test_a_range_error_shows_the_value_as_sent(served, fields, param, message):
    error = _error(served[0], "completion", fields)
    assert error.param == param and message in error.message


@pytest.mark.parametrize("key", [" 1 ", "1_0", "\u0661", "+1", "", "0x1"])
def test_logit_bias_keys_are_plain_decimal_token_ids(served, key):
    error = _error(served[0], "completion", {"logit_bias": {key: 1}})
    assert error.param == "logit_bias"
    assert error.message == f"logit_bias keys must be token ids in decimal digits, got {key!r}"


@pytest.mark.parametrize("key, got", [("-1", "got -1"), ("9" * 30, "got a 30-digit number")])
def test_logit_bias_ids_out_of_int64_are_refused_by_their_range(served, key, got):
    error = _error(served[0], "completion", {"logit_bias": {key: 1}})
    assert error.param == "logit_bias"
    assert error.message == f"logit_bias token id must be in [0, {2**63 - 1}], {got}"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fields, param",
    [
        (lambda vocab: {"stop_token_ids": [vocab]}, "stop_token_ids"),
        (lambda vocab: {"allowed_token_ids": [5, vocab]}, "allowed_token_ids"),
        (lambda vocab: {"logit_bias": {str(vocab): 1}}, "logit_bias"),
        (lambda vocab: {"prompt": [1, vocab]}, "prompt"),
        (lambda vocab: {"prompt": [[1, vocab]]}, "prompt[0]"),
        (lambda vocab: {"prompt": [[1, 2], [1, vocab]]}, "prompt[1]"),
    ],
)
def test_token_ids_past_the_vocabulary_name_their_field(served, fields, param, stream):
    serving, engine = served
    vocab = engine.engine.vocab_size
    error = _error(serving, "completion", {**fields(vocab), "stream": stream})
    assert error.param == param
    assert error.message == f"{param} token id {vocab} is out of range [0, {vocab})"


def test_the_engine_refuses_stop_token_ids_past_the_vocabulary(served):
    _, engine = served
    vocab = engine.engine.vocab_size

    async def first_output() -> None:
        params = SamplingParams(max_tokens=1, stop_token_ids=[vocab])
        await anext(engine.generate([1, 2], params, "stop-past-vocabulary"))

    with pytest.raises(RequestInputError) as raised:
        asyncio.run(first_output())
    assert raised.value.field == "stop_token_ids"


@pytest.mark.parametrize("prompt", [[[1, 2], [1] * 200], ["Hi", "Hi " * 200]])
def test_a_too_long_prompt_among_several_is_named_by_its_index(served, prompt):
    error = _error(served[0], "completion", {"prompt": prompt})
    assert error.param == "prompt[1]" and error.code == "context_length_exceeded"
    assert error.message.startswith("prompt[1] is ")


def test_a_prompt_larger_than_the_whole_kv_cache_is_named_by_its_index():
    engine = AsyncEngine.from_engine_args(
        max_model_len=128, num_gpu_blocks=4, block_size=16, engine_process=False
    )
    try:
        error = _error(OpenAIServing(engine), "completion", {"prompt": [[1, 2], [1] * 100]})
    finally:
        engine.shutdown()
    assert error.param == "prompt[1]"
    assert error.message.startswith("prompt[1] has 100 tokens but the whole KV cache holds ")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "kind, fields, named",
    [
        ("completion", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ("chat", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice 'required'"),
    ],
)
@pytest.mark.parametrize("blocking", [{"min_tokens": 1}, {"ignore_eos": True}])
def test_what_would_run_past_a_structured_outputs_end_is_refused_naming_both_fields(
    served, kind, fields, named, blocking
):
    # A finished value allows only EOS: min_tokens would block it, ignore_eos pass over it
    # (a finished grammar asked for another mask once stopped the engine loop).
    (field,) = blocking
    error = _error(served[0], kind, {**fields, **blocking})
    assert error.param == field
    assert error.message == f"{field} cannot be combined with {named}"
