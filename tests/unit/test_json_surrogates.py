"""A lone UTF-16 surrogate in a JSON body ("\\ud800") is a 400 that says so and names the
field, where the JSON parser's own words ("unexpected end of hex escape") would mislead."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.api.errors import validation_error
from engine.api.protocol import ChatCompletionRequest, CompletionRequest


def _error(request_type, body: bytes):
    with pytest.raises(ValidationError) as info:
        request_type.model_validate_json(body)
    return validation_error(info.value)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (rb'{"prompt": "\ud800"}', "prompt"),
        (rb'{"model": "m", "prompt": "a\ud83db"}', "prompt"),
        (rb'{"prompt": "a\udc00b"}', "prompt"),
        (rb'{"prompt": "\ud800\u0041"}', "prompt"),
        (rb'{"prompt": ["ok", "\ud83d\ude80", "\ud83d"]}', "prompt[2]"),
        (rb'{"prompt": "x", "logit_bias": {"\ud800": 1}}', "logit_bias"),
        (rb'{"prompt": "x", "stop": ["\udfff"]}', "stop[0]"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(body, field):
    err = _error(CompletionRequest, body)
    assert (err.status_code, err.param) == (400, field)
    assert err.message.startswith(f"{field} has a lone UTF-16 surrogate")
    assert "hex escape" not in err.message


def test_a_chat_message_s_surrogate_is_named_by_its_path():
    body = rb'{"model": "m", "messages": [{"role": "user", "content": "hi \udbff"}]}'
    err = _error(ChatCompletionRequest, body)
    assert err.param == "messages[0].content"
    assert "lone UTF-16 surrogate" in err.message


@pytest.mark.parametrize(
    "body", [rb'{"prompt": "\u12"}', rb'{"prompt": "\ud800', b'{"prompt": "\xed\xa0\x80"}']
)
def test_other_broken_json_is_still_reported_as_such(body):
    err = _error(CompletionRequest, body)
    assert err.status_code == 400 and err.param is None
    assert err.message.startswith("the request body is not valid JSON")


def test_a_surrogate_pair_is_one_character():
    assert CompletionRequest.model_validate_json(rb'{"prompt": "\ud83d\ude80"}').prompt == "🚀"
