"""An output read for tool calls, as OpenAI shows it: a response's message, or a stream's
deltas (a call's first delta carries its index, id, type and name; then its index and
arguments text)."""

from __future__ import annotations

from typing import Any

from engine.api.responses import ChatResponseMessage, FunctionCall, ToolCall
from engine.api.tool_parsers import (
    CallArguments,
    CallStart,
    Content,
    Event,
    ToolCallStream,
    extract_tool_calls,
)
from engine.api.tools import ToolUse


def tool_message(
    tools: ToolUse, text: str, finish_reason: str | None
) -> tuple[ChatResponseMessage, str | None]:
    """A whole output's message and finish reason."""
    found = extract_tool_calls(
        tools.new_parser(), tools.visible(text, finish_reason), tools.parallel
    )
    calls = [
        ToolCall(id=tools.new_call_id(), function=FunctionCall(name=name, arguments=arguments))
        for name, arguments in found.calls
    ]
    message = ChatResponseMessage(content=found.content, tool_calls=calls or None)
    return message, tools.finish_reason(finish_reason, bool(calls))


class ToolCallDeltas:
    """One streamed choice's deltas."""

    def __init__(self, tools: ToolUse) -> None:
        self.tools = tools
        self._stream = ToolCallStream(tools.new_parser(), tools.parallel)

    def deltas(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        """The deltas for the text the output adds (`finish_reason`: it ended with it)."""
        events = self._stream.feed(self.tools.visible(text, finish_reason))
        if finish_reason is not None:
            events += self._stream.finish()
        return _deltas(events, self.tools.new_call_id)

    def finish_reason(self, finish_reason: str) -> str:
        return self.tools.finish_reason(finish_reason, self._stream.called)


def _deltas(events: list[Event], new_call_id: Any) -> list[dict[str, Any]]:
    deltas: list[dict[str, Any]] = []
    for event in events:
        last = deltas[-1] if deltas else {}
        if isinstance(event, Content):
            if "content" in last:
                last["content"] += event.text
            else:
                deltas.append({"content": event.text})
        elif isinstance(event, CallStart):
            function = {"name": event.name, "arguments": ""}
            call = {
                "index": event.index,
                "id": new_call_id(),
                "type": "function",
                "function": function,
            }
            deltas.append({"tool_calls": [call]})
        elif isinstance(event, CallArguments):
            calls = last.get("tool_calls")
            if calls and calls[-1]["index"] == event.index:
                calls[-1]["function"]["arguments"] += event.text
            else:
                call = {"index": event.index, "function": {"arguments": event.text}}
                deltas.append({"tool_calls": [call]})
    return deltas
