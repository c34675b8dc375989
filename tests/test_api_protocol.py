"""Request validation: every malformed body becomes a 400 that names the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    PromptLogprob,
    validation_error,
)


def _error(cls, body) -> APIError:
    with pytest.raises(ValidationError) as info:
        cls.model_validate_json(body if isinstance(body, str) else json.dumps(body))
    return validation_error(info.value)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


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
    ],
)
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


def test_api_error_survives_pickling_with_its_status():
    import pickle

    err = APIError("slow down", 429, code="rate_limit_exceeded", retry_after_s=2.4)
    back = pickle.loads(pickle.dumps(err))
    assert (back.status_code, back.code, back.headers()) == (
        429,
        "rate_limit_exceeded",
        {"Retry-After": "2"},
    )


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
