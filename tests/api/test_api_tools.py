"""Tool calling in OpenAIServing over a scripted engine that writes given text: request
checks, what reaches the chat template and the engine, and calls read out of the output,
whole and streamed."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken

from engine import LLM
from engine.api.errors import APIError
from engine.api.protocol import ChatCompletionRequest, TokenizeRequest
from engine.api.serving import OpenAIServing
from engine.tokenizer import ChatInputError
from tests.support.fakes import HERMES_CALL, WEATHER, TextEngine
from tests.support.openai_streams import (
    assert_stream_agrees,
    full_and_streamed,
    streamed_logprobs,
)

CLOCK = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# A small Qwen-like template: tools in a system turn, calls as <tool_call> JSON (arguments
# must be an object for tojson to render them as one), results as <tool_response>.
TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls -%}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{% endfor %}{% elif message.role == "tool" -%}
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response>
{% else %}{{ message.content }}
{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    with_tools = copy.deepcopy(tokenizer)
    with_tools.chat_template = TOOLS_TEMPLATE
    return with_tools


def _serving(tokenizer, text: str = "Sunny.", parser: str | None = "hermes", **engine_kw):
    engine = TextEngine(tokenizer, text, **engine_kw)
    serving = OpenAIServing(
        engine, enable_auto_tool_choice=parser is not None, tool_call_parser=parser
    )
    return serving, engine


def _chat(**fields) -> ChatCompletionRequest:
    body = {"messages": ASK, "tools": [WEATHER, CLOCK], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


SCRIPTS = {
    "hermes": "Let me check.\n" + HERMES_CALL + "\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": 'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
    '"Paris"}}, {"name": "get_time", "arguments": {}}]',
}


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_auto_reads_the_models_calls_whole_and_streamed(tokenizer, parser):
    serving, engine = _serving(tokenizer, SCRIPTS[parser], parser)
    full, events = full_and_streamed(serving, _chat())
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == (None if parser == "llama3_json" else "Let me check.")
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    id_pattern = r"[A-Za-z0-9]{9}" if parser == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"
    assert all(re.fullmatch(id_pattern, c.id) for c in calls)
    assert len({c.id for c in calls}) == 2
    assert_stream_agrees(full, events)
    assert engine.calls[0]["params"].structured_output is None  # auto: the model's free text
    body = full.model_dump(mode="json")["choices"][0]["message"]
    assert body["content"] is None or body["content"] == "Let me check."
    assert body["tool_calls"][0]["type"] == "function"


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_a_call_cut_short_by_max_tokens_is_the_same_call_whole_and_streamed(tokenizer, parser):
    script = SCRIPTS[parser]
    cut = script[: script.index('"Paris"') + len('"Par')]
    serving, _ = _serving(tokenizer, cut, parser, finish_reason="length")
    full, events = full_and_streamed(serving, _chat())
    choice = full.choices[0]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Par')
    ]
    assert choice.message.content == (None if parser == "llama3_json" else "Let me check.")
    assert choice.finish_reason == "length"  # the call is unfinished
    assert_stream_agrees(full, events)


def test_auto_without_calls_is_plain_content(tokenizer):
    text = "It is sunny in Paris; no tool needed. 1 < 2."
    serving, _ = _serving(tokenizer, text)
    full, events = full_and_streamed(serving, _chat())
    assert full.choices[0].message.content == text
    assert full.choices[0].finish_reason == "stop"
    assert "tool_calls" not in full.model_dump(mode="json")["choices"][0]["message"]
    assert_stream_agrees(full, events)


def test_malformed_calls_come_back_as_content_not_an_error(tokenizer):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
    serving, _ = _serving(tokenizer, text)
    full, events = full_and_streamed(serving, _chat())
    assert full.choices[0].message.content == text
    assert full.choices[0].message.tool_calls is None
    assert full.choices[0].finish_reason == "stop"
    assert events[-1] == "[DONE]"  # the stream ends normally too
    assert all("error" not in e for e in events[:-1])


def test_each_of_n_choices_is_read_for_calls_and_logprobs_all_arrive(tokenizer):
    serving, engine = _serving(tokenizer, SCRIPTS["hermes"])
    full, events = full_and_streamed(serving, _chat(n=2, logprobs=True))
    assert [len(c.message.tool_calls) for c in full.choices] == [2, 2]
    assert_stream_agrees(full, events)
    for index in (0, 1):
        # Held-back text's tokens come later, not never.
        assert len(streamed_logprobs(events, index)) == len(engine.ids)


def test_parallel_tool_calls_false_keeps_one_call(tokenizer):
    serving, _ = _serving(tokenizer, SCRIPTS["hermes"])
    full, events = full_and_streamed(serving, _chat(parallel_tool_calls=False))
    assert [c.function.name for c in full.choices[0].message.tool_calls] == ["get_weather"]
    assert_stream_agrees(full, events)


def test_tool_choice_none_sends_the_tools_to_the_template_and_reads_nothing(tools_tokenizer):
    serving, engine = _serving(tools_tokenizer, HERMES_CALL)
    full, _ = full_and_streamed(serving, _chat(tool_choice="none"))
    assert full.choices[0].message.content == HERMES_CALL
    assert full.choices[0].finish_reason == "stop"
    assert '"name": "get_weather"' in tools_tokenizer.decode(engine.calls[0]["prompt"])


def test_named_and_required_choices_constrain_the_output_with_a_grammar(tokenizer):
    serving, engine = _serving(tokenizer, '{"city": "Paris"}', parser=None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    full, events = full_and_streamed(serving, _chat(tool_choice=named))
    assert (
        json.loads(engine.calls[0]["params"].structured_output.json_schema)
        == (WEATHER["function"]["parameters"])
    )
    choice = full.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"  # OpenAI's
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert_stream_agrees(full, events)

    calls = '[{"name": "get_time", "parameters": {}}]'
    serving, engine = _serving(tokenizer, calls, parser=None)
    full, events = full_and_streamed(serving, _chat(tool_choice="required"))
    schema = json.loads(engine.calls[0]["params"].structured_output.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"$ref": "#/$defs/tool1"}
    assert schema["$defs"]["tool1"]["type"] == "object"
    assert full.choices[0].finish_reason == "tool_calls"
    assert full.choices[0].message.tool_calls[0].function.arguments == "{}"
    assert_stream_agrees(full, events)
    asyncio.run(
        serving.create_chat_completion(_chat(tool_choice="required", parallel_tool_calls=False))
    )
    assert json.loads(engine.calls[-1]["params"].structured_output.json_schema)["maxItems"] == 1


def _required_schema(tokenizer, tools: list[dict]) -> dict:
    serving, engine = _serving(tokenizer, "[]", parser=None)
    asyncio.run(serving.create_chat_completion(_chat(tools=tools, tool_choice="required")))
    return json.loads(engine.calls[0]["params"].structured_output.json_schema)


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_required_keeps_each_tools_refs_pointing_into_its_own_parameters(tokenizer):
    place = {"$defs": {"place": {"type": "string"}}, "type": "object",
             "properties": {"city": {"$ref": "#/$defs/place"}}}  # fmt: skip
    other_place = {**place, "$defs": {"place": {"type": "integer"}}}
    old_style = {"definitions": {"unit": {"enum": ["c", "f"]}}, "type": "object",
                 "properties": {"unit": {"$ref": "#/definitions/unit"},
                                "also": {"$ref": "#/properties/unit"},
                                "more": {"type": "array", "items": {"$ref": "#"}},
                                "$ref": {"type": "string", "default": {"$ref": "#/x"}}}}  # fmt: skip
    tools = [_tool("visit", place), _tool("post", other_place), _tool("units", old_style)]
    schema = _required_schema(tokenizer, tools)
    calls = schema["items"]["anyOf"]
    assert [c["properties"]["parameters"] for c in calls] == [
        {"$ref": f"#/$defs/tool{i}"} for i in range(3)
    ]
    visit, post, units = (schema["$defs"][f"tool{i}"] for i in range(3))
    assert visit["properties"]["city"] == {"$ref": "#/$defs/tool0/$defs/place"}
    assert post["properties"]["city"] == {"$ref": "#/$defs/tool1/$defs/place"}
    assert post["$defs"] == {"place": {"type": "integer"}}  # the same name, its own schema
    assert units["properties"] == {
        "unit": {"$ref": "#/$defs/tool2/definitions/unit"},
        "also": {"$ref": "#/$defs/tool2/properties/unit"},
        "more": {"type": "array", "items": {"$ref": "#/$defs/tool2"}},
        # A property called "$ref", and data that looks like a ref, stay as they were.
        "$ref": {"type": "string", "default": {"$ref": "#/x"}},
    }
    assert tools[2]["function"]["parameters"] == old_style  # the request is left alone


def test_required_drops_the_id_that_would_move_its_refs_base(tokenizer):
    identified = {"$id": "https://example.com/visit", "type": "object",
                  "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}}  # fmt: skip
    (visit,) = _required_schema(tokenizer, [_tool("visit", identified)])["$defs"].values()
    assert "$id" not in visit and visit["properties"]["b"] == {"$ref": "#/$defs/tool0/properties/a"}


def test_mistral_keeps_its_special_marker_and_drops_the_end_of_sequence(tokenizer):
    mistral_like = copy.deepcopy(tokenizer)
    mistral_like.add_tokens([AddedToken("[TOOL_CALLS]", special=True)], special_tokens=True)
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    serving, engine = _serving(mistral_like, text, "mistral", end_with_eos=True)
    full, events = full_and_streamed(serving, _chat())
    assert engine.calls[0]["params"].skip_special_tokens is False
    assert full.choices[0].message.content is None
    assert full.choices[0].message.tool_calls[0].function.name == "get_time"
    assert_stream_agrees(full, events)


def test_a_conversation_with_tools_calls_and_results_reaches_the_template(tools_tokenizer):
    serving, engine = _serving(tools_tokenizer, HERMES_CALL)
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]  # fmt: skip
    asyncio.run(serving.create_chat_completion(_chat(messages=messages)))
    prompt = tools_tokenizer.decode(engine.calls[0]["prompt"])
    assert json.dumps(WEATHER) in prompt.replace("\n", "")
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    )
    assert '<tool_response id="call_1">18 C, sunny</tool_response>' in prompt
    counted = TokenizeRequest.model_validate({"messages": messages, "tools": [WEATHER, CLOCK]})
    assert asyncio.run(serving.tokenize(counted)).tokens == engine.calls[0]["prompt"]


def _error(serving, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_chat_completion(_chat(**fields)))
    assert info.value.status_code == 400
    return info.value


BAD_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "string"}},
}
CALL = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "'nope' is not one of the tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "earlier tool"),
        ({"tools": [BAD_TOOL]}, "tools[0].function.parameters", "object"),
        ({"tools": [{**BAD_TOOL, "function": {"name": "f", "parameters": {"type": "objec"}}}]},
         "tools[0].function.parameters", "not a valid JSON schema"),
        ({"tools": [{**BAD_TOOL, "function": {"name": "f", "parameters": {"$schema": 5}}}]},
         "tools[0].function.parameters.$schema", "URI string"),
        ({"tools": [{**BAD_TOOL, "function": {"name": "f", "parameters": {"$schema": ["x"]}}}]},
         "tools[0].function.parameters.$schema", "URI string"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
          "structured_outputs": {"regex": "a+"}}, "structured_outputs", "tool_choice"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id", "required"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
         "messages[0].tool_calls", "assistant"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [CALL]}]},
         "messages[1].tool_calls[0].function.arguments", "JSON object"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
            {**CALL, "function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages[1].tool_calls[0].function.arguments", "JSON object"),
        ({"tools": [WEATHER, _tool("f", {"properties": {"a": {"$ref": "https://x.org/a"}}})],
          "tool_choice": "required"},
         "tools[1].function.parameters", "'https://x.org/a' is not a JSON pointer"),
        ({"tools": [_tool("f", {"$defs": {"a": {"$anchor": "a"}},
                                "properties": {"b": {"$ref": "#a"}}})],
          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools[0].function.parameters", "'#a' is not a JSON pointer"),
        ({"tools": [_tool("f", {"$id": "https://x.org/f", "properties": {"b": {"$ref": "g"}}})],
          "tool_choice": "required"},
         "tools[0].function.parameters", "'g' is not a JSON pointer"),
        ({"tools": [WEATHER, _tool("f", {"properties": {"tags": {
            "type": "array", "items": {"type": "string"}, "uniqueItems": True}}})],
          "tool_choice": "required"},
         "tools[1].function.parameters", '"uniqueItems" at #/properties/tags/uniqueItems'),
        ({"tools": [_tool("f", {"properties": {"n": {"type": "integer", "not": {"const": 3}}}})],
          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools[0].function.parameters", '"not" at #/properties/n/not'),
    ],
)  # fmt: skip
def test_bad_tool_input_is_a_400_naming_the_field(tokenizer, fields, param, words):
    serving, engine = _serving(tokenizer)
    err = _error(serving, **fields)
    assert err.param == param and param in err.message and words in err.message
    assert not engine.calls


def test_auto_without_a_parser_says_what_to_set(tokenizer):
    serving, _ = _serving(tokenizer, parser=None)
    for fields in ({}, {"tool_choice": "auto"}):
        err = _error(serving, **fields)
        assert err.param == "tool_choice"
        assert "enable_auto_tool_choice" in err.message and "tool_call_parser" in err.message
    with pytest.raises(ValueError, match="tool_call_parser"):
        OpenAIServing(TextEngine(tokenizer, "x"), enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        OpenAIServing(TextEngine(tokenizer, "x"), tool_call_parser="qwen9")


def test_offline_chat_renders_the_tools_into_its_prompt(tools_tokenizer):
    llm = LLM.__new__(LLM)  # the template path alone: no model to load
    llm.engine = SimpleNamespace(tokenizer=tools_tokenizer)
    llm.generate = lambda prompts, params: prompts
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}]
    (prompt,) = llm.chat(messages, tools=[WEATHER])
    text = tools_tokenizer.decode(prompt)
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]
    assert '"arguments": {"city": "Paris"}}</tool_call>' in text
    with pytest.raises(
        ChatInputError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"
    ):
        bad = {**call, "function": {"name": "f", "arguments": "[]"}}
        llm.chat([*ASK, {"role": "assistant", "content": "", "tool_calls": [bad]}])
