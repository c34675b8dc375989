"""A parser's events made into a response's content and calls, whole (`extract_tool_calls`)
or as a stream (`ToolCallStream`), by the same rules: with parallel_tool_calls false only the
first call counts, and once calls were made, whitespace after the last text is left out
(content that is only whitespace is none)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.api.tool_parsers.base import (
    CallArguments,
    CallBroken,
    CallStart,
    Content,
    Event,
    ToolParser,
)


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    """None when the output was calls alone."""
    calls: list[tuple[str, str]]
    """(name, arguments text) of each call."""


def extract_tool_calls(parser: ToolParser, text: str, parallel: bool = True) -> ExtractedToolCalls:
    """The calls in a whole output; a call that is not valid JSON is content, as written
    (one the output's end cuts short stays a call, as in a stream)."""
    parts: list[str | int] = []
    calls: dict[int, list[str]] = {}
    for event in _counted(parser.feed(text) + parser.finish(), parallel):
        if isinstance(event, Content):
            parts.append(event.text)
        elif isinstance(event, CallStart):
            parts.append(event.index)
            calls[event.index] = [event.name, ""]
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.text
        else:
            parts[parts.index(event.index)] = event.raw
            del calls[event.index]
    content = "".join(part for part in parts if isinstance(part, str))
    if calls:
        content = content.rstrip() or None
    return ExtractedToolCalls(content, [(name, arguments) for name, arguments in calls.values()])


class ToolCallStream:
    """A choice's events as it streams. Whitespace content waits for the text after it (none
    follows the last call's); a call that breaks after its name went out stays sent, and the
    rest of its text comes as content."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.called = False
        """A call has started."""
        self._space = ""

    def feed(self, text: str) -> list[Event]:
        return self._shown(self.parser.feed(text))

    def finish(self) -> list[Event]:
        events = self._shown(self.parser.finish())
        if self._space and not self.called:
            events.append(Content(self._space))
        self._space = ""
        return events

    def _shown(self, events: list[Event]) -> list[Event]:
        shown: list[Event] = []
        for event in _counted(events, self.parallel):
            if isinstance(event, Content):
                text = self._space + event.text
                body = text.rstrip()
                self._space = text[len(body) :]
                if body:
                    shown.append(Content(body))
            elif not isinstance(event, CallBroken):
                self.called = self.called or isinstance(event, CallStart)
                shown.append(event)
        return shown


def _counted(events: list[Event], parallel: bool) -> list[Event]:
    if parallel:
        return events
    return [e for e in events if isinstance(e, Content) or e.index == 0]
