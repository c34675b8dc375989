"""A tool's function name takes OpenAI's form, ^[a-zA-Z0-9_-]{1,64}$, or is a 400 naming it."""

from __future__ import annotations

import pytest

from engine.api.errors import APIError
from engine.api.protocol import ChatTool
from engine.api.tools import check_tools


def _tools(*names: str) -> list[ChatTool]:
    return [ChatTool.model_validate({"type": "function", "function": {"name": n}}) for n in names]


def test_names_of_letters_digits_underscores_and_dashes_up_to_64_are_taken():
    check_tools(_tools("get_weather", "get-time-2", "A" * 64, "x"))


@pytest.mark.parametrize(
    "bad", ["get weather", "a.b", "ns/fn", "naïve", "f(x)", "fn\n", "A" * 65, "函数"]
)
def test_other_names_are_a_400_naming_the_tool_s_field(bad):
    with pytest.raises(APIError) as info:
        check_tools(_tools("get_weather", bad))
    err = info.value
    assert (err.status_code, err.param) == (400, "tools[1].function.name")
    assert err.message.startswith("tools[1].function.name: ") and repr(bad) in err.message
    assert "1 to 64 letters, digits, underscores or dashes" in err.message
