"""Request validation: every malformed body becomes a 400 that names the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.api.errors import APIError, validation_error
from engine.api.protocol import ChatCompletionRequest, CompletionRequest
from engine.api.responses import CompletionChoice, CompletionChunk, PromptLogprob


def _error(cls, body) -> APIError:
    with pytest.raises(ValidationError) as info:
        cls.model_validate_json(body if isinstance(body, str) else json.dumps(body))
    return validation_error(info.value)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
FUNCTION = {"name": "get_weather", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "user"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
        ({**CHAT, "messages": []}, "messages", "at least 1"),
        ({"model": "m"}, "messages", "required"),
        ({**CHAT, "max_tokens": "ten"}, "max_tokens", "integer"),
        ({**CHAT, "max_tokens": 2.5}, "max_tokens", "integer"),
        ({**CHAT, "temperature": "hot"}, "temperature", "number"),
        ({**CHAT, "stream": "yes"}, "stream", "boolean"),
        ({**CHAT, "top_logprobs": 99}, "top_logprobs", "20"),
        ({**CHAT, "stop": 7}, "stop", "string"),
        ({**CHAT, "max_tokenz": 5}, "max_tokenz", "not a supported field"),
        ({**CHAT, "echo": True}, "echo", "not a supported field"),
        (
            {**CHAT, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
            "boolean",
        ),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "required"),
        ({**CHAT, "tools": [{"type": "retrieval", "function": FUNCTION}]}, "tools[0].type", "function"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": ""}}]},
         "tools[0].function.name", "at least 1"),
        ({**CHAT, "tools": [{"type": "function", "function": {**FUNCTION, "parameter": {}}}]},
         "tools[0].function.parameter", "not a supported field"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
         "tools[0].function.parameters", "object"),
        ({**CHAT, "tool_choice": "always"}, "tool_choice", "'auto'"),
        ({**CHAT, "tool_choice": {"type": "function", "function": {}}},
         "tool_choice.function.name", "required"),
        ({**CHAT, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({**CHAT, "messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
         "messages[0].tool_calls[0].function.arguments", "string"),
    ],
)  # fmt: skip
def test_chat_body_errors_name_the_field(body, param, words):
    err = _error(ChatCompletionRequest, body)
    assert err.status_code == 400
    assert err.param == param
    assert param in err.message and words in err.message
    body = err.to_response().model_dump()
    assert set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": {"text": "hi"}}, "prompt"),
        ({"model": "m", "prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"model": "m", "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"model": "m", "prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"model": "m", "prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
        ({"model": "m", "prompt": "hi", "n": 0}, "n"),
        ({"model": "m", "prompt": "hi", "seed": "1"}, "seed"),
    ],
)
def test_completion_body_errors_name_the_field(body, param):
    err = _error(CompletionRequest, body)
    assert err.status_code == 400 and err.param == param


PART = {"type": "text", "text": "a"}
IMAGE = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
PROMPT = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("cls", "body", "param", "words"),
    [
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [PART, IMAGE]}]},
         "messages[0].content[1].type", "should be 'text', got 'image_url'"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [AUDIO]}]},
         "messages[0].content[0].type", "should be 'text', got 'input_audio'"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "bot", "content": "a"}]},
         "messages[0].role", "got 'bot'"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user" * 40, "content": "a"}]},
         "messages[0].role", "got 'useruseruser"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text", "is required"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": ["a"]}]},
         "messages[0].content[0]", "object"),
        (ChatCompletionRequest, {**CHAT, "stop": ["a", 1]}, "stop[1]", "valid string"),
        (CompletionRequest, {**PROMPT, "stop": ["a", 1]}, "stop[1]", "valid string"),
        (CompletionRequest, {**PROMPT, "prompt": [1, "a"]}, "prompt[1]", "valid integer"),
        (CompletionRequest, {**PROMPT, "prompt": ["a", 1]}, "prompt[1]", "valid string"),
        (CompletionRequest, {**PROMPT, "prompt": [[1, 2], "a"]}, "prompt[1]", "valid array"),
        (CompletionRequest, {**PROMPT, "prompt": [[1, "a"]]}, "prompt[0][1]", "valid integer"),
        # Members that fail equally far in are all named.
        (CompletionRequest, {**PROMPT, "prompt": [1.5]}, "prompt[0]",
         "valid string or Input should be a valid integer or Input should be a valid array"),
    ],
)  # fmt: skip
def test_a_union_error_names_the_problem_in_the_member_the_value_fits(cls, body, param, words):
    err = _error(cls, body)
    assert err.status_code == 400
    assert err.param == param
    assert err.message.startswith(param) and words in err.message


@pytest.mark.parametrize("cls, body", [(ChatCompletionRequest, CHAT), (CompletionRequest, PROMPT)])
@pytest.mark.parametrize("stream", [{}, {"stream": False}])
def test_stream_options_without_streaming_is_a_400(cls, body, stream):
    err = _error(cls, {**body, **stream, "stream_options": {"include_usage": True}})
    assert err.status_code == 400 and err.param == "stream_options"
    assert err.message == "stream_options: only allowed when `stream` is true"


@pytest.mark.parametrize("cls, body", [(ChatCompletionRequest, CHAT), (CompletionRequest, PROMPT)])
def test_stream_options_parse_with_streaming_or_as_null(cls, body):
    options = {"include_usage": True}
    assert cls.model_validate({**body, "stream": True, "stream_options": options}).stream_options
    assert cls.model_validate({**body, "stream_options": None}).stream_options is None


def test_malformed_json_is_a_400():
    err = _error(CompletionRequest, '{"prompt": "unterminated')
    assert err.status_code == 400 and "JSON" in err.message


def test_valid_bodies_parse_with_openai_defaults():
    chat = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
        )
    )
    assert chat.n == 1 and not chat.stream and chat.max_tokens is None
    completion = CompletionRequest.model_validate_json('{"model": "m", "prompt": [1, 2, 3]}')
    assert completion.prompt == [1, 2, 3] and completion.max_tokens == 16


def test_a_conversation_with_tools_parses():
    body = {
        **CHAT,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        ],
        "tools": [{"type": "function", "function": {**FUNCTION, "description": "d", "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }  # fmt: skip
    chat = ChatCompletionRequest.model_validate_json(json.dumps(body))
    assert chat.messages[1].content is None
    assert chat.messages[1].tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert chat.messages[2].tool_call_id == "call_1"
    assert chat.tool_choice.function.name == "get_weather" and not chat.parallel_tool_calls
    plain = ChatCompletionRequest.model_validate_json(json.dumps(CHAT))
    assert (plain.tools, plain.tool_choice, plain.parallel_tool_calls) == (None, None, True)
    for choice in ("none", "auto", "required"):
        assert (
            ChatCompletionRequest.model_validate({**CHAT, "tool_choice": choice}).tool_choice
            == choice
        )


def test_api_error_survives_pickling_with_its_status():
    import pickle

    err = APIError("slow down", 429, code="rate_limit_exceeded", retry_after_s=2.4)
    back = pickle.loads(pickle.dumps(err))
    assert (back.status_code, back.code, back.headers()) == (
        429,
        "rate_limit_exceeded",
        {"Retry-After": "3"},
    )


def test_retry_after_rounds_up_so_a_client_waiting_that_long_is_not_refused_again():
    assert APIError("wait", 429, retry_after_s=40.4).headers() == {"Retry-After": "41"}
    assert APIError("wait", 429, retry_after_s=40.0).headers() == {"Retry-After": "40"}
    assert APIError("wait", 429, retry_after_s=0.0).headers() == {"Retry-After": "1"}


def test_prompt_logprobs_appear_in_a_choices_json_only_when_given():
    plain = CompletionChoice(index=0, text="a")
    chunk = CompletionChunk(id="c", created=0, model="m", choices=[plain])
    assert "prompt_logprobs" not in json.loads(chunk.model_dump_json())["choices"][0]
    assert "prompt_logprobs" not in plain.model_dump(mode="json")
    scored = CompletionChoice(
        index=0,
        text="a",
        prompt_logprobs=[None, {7: PromptLogprob(logprob=-0.5, rank=1, decoded_token="a")}],
    )
    assert scored.model_dump(mode="json")["prompt_logprobs"] == [
        None,
        {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}},
    ]


@pytest.mark.parametrize(
    "status, err_type",
    [
        (400, "BadRequestError"),
        (405, "MethodNotAllowedError"),
        (499, "InvalidRequestError"),
        (422, "InvalidRequestError"),
        (500, "InternalServerError"),
        (502, "InternalServerError"),
    ],
)
def test_an_error_type_blames_the_server_only_for_a_5xx(status, err_type):
    assert APIError("x", status).to_response().error.type == err_type
