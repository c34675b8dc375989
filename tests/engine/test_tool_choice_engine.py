"""tool_choice with a function named or "required", on the real engine (bundled SmolLM2,
whose template knows nothing of tools): the grammar makes any model call the tools. And the
grammars themselves, compiled as the engine compiles them, against a JSON schema validator."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import xgrammar as xgr

from engine.api.protocol import ChatCompletionRequest
from engine.api.serving import OpenAIServing
from engine.api.tools import tool_use
from engine.async_engine import AsyncEngine
from engine.structured_output import StructuredOutputs
from tests.support.openai_streams import assert_stream_agrees, sse_events

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
# Refs that embedding the parameters in a larger schema must keep pointing where they did:
# draft-7 definitions, a pointer to a property, the whole schema (recursion).
REFERRING_WEATHER = {
    "name": "compare_weather",
    "description": "The current weather in a city and in the user's home city",
    "parameters": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"$ref": "#/definitions/unit"},
            "home_city": {"$ref": "#/properties/city"},
        },
        "required": ["city", "unit", "home_city"],
    },
}
TREE = {
    "name": "make_tree",
    "parameters": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 10},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["label", "children"],
        "additionalProperties": False,
    },
}
# Two tools whose $defs share a name.
VISIT, POST = (
    {
        "name": name,
        "parameters": {
            "$defs": {"place": place},
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/place"}},
            "required": ["to"],
        },
    }
    for name, place in (("visit", {"type": "string"}), ("post", {"type": "integer"}))
)
SCHEMAS = {
    f["name"]: f["parameters"] for f in (WEATHER, TIME, REFERRING_WEATHER, TREE, VISIT, POST)
}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


@pytest.fixture(scope="module")
def serving():
    engine = AsyncEngine.from_engine_args(max_model_len=512, max_num_seqs=4, engine_process=False)
    yield OpenAIServing(engine)
    engine.shutdown()


def _tools(*functions: dict) -> list[dict]:
    return [{"type": "function", "function": f} for f in functions]


def _run(serving, **fields):
    body = {
        "messages": ASK,
        "tools": _tools(WEATHER, TIME),
        "temperature": 0,
        "max_tokens": 120,
        **fields,
    }
    request = ChatCompletionRequest.model_validate_json(json.dumps(body))

    async def run():
        full = await serving.create_chat_completion(request)
        streamed = request.model_copy(update={"stream": True})
        return full, await sse_events(await serving.create_chat_completion(streamed))

    return asyncio.run(run())


def _checked_calls(choice) -> list[str]:
    """The calls' names, each call's arguments valid for its tool's schema."""
    assert choice.message.content is None
    for call in choice.message.tool_calls:
        assert _follows_its_tool(call.function.name, json.loads(call.function.arguments))
    return [call.function.name for call in choice.message.tool_calls]


def _follows_its_tool(name: str, arguments: object) -> bool:
    schema = SCHEMAS[name]
    return jsonschema.validators.validator_for(schema)(schema).is_valid(arguments)


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(serving):
    named = {"type": "function", "function": {"name": "get_weather"}}
    full, events = _run(serving, tool_choice=named)
    choice = full.choices[0]
    assert _checked_calls(choice) == ["get_weather"]
    assert choice.finish_reason == "stop"  # OpenAI's for a named choice
    assert_stream_agrees(full, events)


def test_required_calls_one_or_more_of_the_tools(serving):
    full, events = _run(serving, tool_choice="required")
    choice = full.choices[0]
    assert len(_checked_calls(choice)) >= 1
    assert choice.finish_reason == "tool_calls"
    assert_stream_agrees(full, events)


def test_required_without_parallel_calls_makes_exactly_one(serving):
    full, events = _run(serving, tool_choice="required", parallel_tool_calls=False)
    assert len(_checked_calls(full.choices[0])) == 1
    assert_stream_agrees(full, events)


def test_required_follows_refs_within_a_tools_parameters(serving):
    tools = _tools(REFERRING_WEATHER)
    full, events = _run(serving, tools=tools, tool_choice="required", parallel_tool_calls=False)
    choice = full.choices[0]
    assert _checked_calls(choice) == ["compare_weather"]
    assert choice.finish_reason == "tool_calls"
    assert_stream_agrees(full, events)


@pytest.fixture(scope="module")
def compiler(bundled_tokenizer):
    """The bundled model's tokenizer, and grammars compiled as the engine compiles them."""
    tokenizer = bundled_tokenizer
    return tokenizer, StructuredOutputs(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def _required_grammar(compiler, functions: list[dict]):
    tokenizer, structured = compiler
    body = {"messages": ASK, "tools": _tools(*functions), "tool_choice": "required"}
    request = ChatCompletionRequest.model_validate(body)
    return structured.grammar(tool_use(request, None, False, tokenizer).structured_output)


# Each tool with those offered beside it: visit and post have $defs of the same name.
OFFERED = {
    "compare_weather": [REFERRING_WEATHER],
    "make_tree": [TREE],
    "visit": [VISIT, POST],
    "post": [VISIT, POST],
}
WEATHER_IN = {"city": "Paris", "unit": "celsius", "home_city": "Lyon"}
LEAF = {"label": "b", "children": []}
CALLS = [
    ("compare_weather", WEATHER_IN, True),
    ("compare_weather", {**WEATHER_IN, "unit": "kelvin"}, False),
    ("compare_weather", {**WEATHER_IN, "home_city": 5}, False),
    ("make_tree", {"label": "a", "children": [LEAF]}, True),
    ("make_tree", {"label": "a", "children": [{**LEAF, "x": 1}]}, False),
    # What "#" would mean in the list of calls, were it not rewritten.
    ("make_tree", {"label": "a", "children": [[{"name": "make_tree", "parameters": LEAF}]]}, False),
    ("visit", {"to": "Paris"}, True),
    ("visit", {"to": 75}, False),
    ("post", {"to": 75}, True),
    ("post", {"to": "Paris"}, False),
]


@pytest.mark.parametrize(("name", "arguments", "allowed"), CALLS)
def test_a_required_grammar_takes_exactly_the_calls_each_tools_schema_allows(
    compiler, name, arguments, allowed
):
    assert _follows_its_tool(name, arguments) == allowed
    matcher = xgr.GrammarMatcher(_required_grammar(compiler, OFFERED[name]))
    text = json.dumps([{"name": name, "parameters": arguments}])
    assert (matcher.accept_string(text) and matcher.is_completed()) == allowed
