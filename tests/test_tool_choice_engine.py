"""tool_choice with a function named or "required", on the real engine (bundled SmolLM2,
whose template knows nothing of tools): the grammar makes any model call the tools."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from engine.api.protocol import ChatCompletionRequest
from engine.api.serving import OpenAIServing
from engine.async_engine import AsyncEngine
from tests.test_api_serving import _events
from tests.test_api_tools import _agree

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
TIME = {
    "name": "get_time",
    "description": "The time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 40}},
        "required": ["zone"],
    },
}
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


@pytest.fixture(scope="module")
def serving():
    engine = AsyncEngine.from_engine_args(max_model_len=512, max_num_seqs=4, engine_process=False)
    yield OpenAIServing(engine)
    engine.shutdown()


def _run(serving, **fields):
    body = {
        "messages": ASK,
        "tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)],
        "temperature": 0,
        "max_tokens": 120,
        **fields,
    }
    request = ChatCompletionRequest.model_validate_json(json.dumps(body))

    async def run():
        full = await serving.create_chat_completion(request)
        streamed = request.model_copy(update={"stream": True})
        return full, await _events(await serving.create_chat_completion(streamed))

    return asyncio.run(run())


def _checked_calls(choice) -> list[str]:
    """The calls' names, each call's arguments valid for its tool's schema."""
    assert choice.message.content is None
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [call.function.name for call in choice.message.tool_calls]


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(serving):
    named = {"type": "function", "function": {"name": "get_weather"}}
    full, events = _run(serving, tool_choice=named)
    choice = full.choices[0]
    assert _checked_calls(choice) == ["get_weather"]
    assert choice.finish_reason == "stop"  # OpenAI's for a named choice
    _agree(full, events)


def test_required_calls_one_or_more_of_the_tools(serving):
    full, events = _run(serving, tool_choice="required")
    choice = full.choices[0]
    assert len(_checked_calls(choice)) >= 1
    assert choice.finish_reason == "tool_calls"
    _agree(full, events)


def test_required_without_parallel_calls_makes_exactly_one(serving):
    full, events = _run(serving, tool_choice="required", parallel_tool_calls=False)
    assert len(_checked_calls(full.choices[0])) == 1
    _agree(full, events)
