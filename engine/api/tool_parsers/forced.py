"""Outputs that tool_choice constrained to calls (engine/api/tools.py builds the grammars):
a named function's arguments, or for "required" a JSON list of
`{"name": ..., "parameters": {...}}`."""

from __future__ import annotations

from engine.api.tool_parsers.base import CallArguments, CallStart, Event, ToolParser
from engine.api.tool_parsers.json_list import JSONListToolParser


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the one call to `name`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _read(self) -> None:
        if self._pending:
            self._start()
            self._events.append(CallArguments(0, self._pending))
            self._pending = ""

    def _end(self) -> None:
        self._start()

    def _start(self) -> None:
        if not self._num_calls:
            self._num_calls = 1
            self._events.append(CallStart(0, self.name))


class RequiredToolParser(JSONListToolParser):
    arguments_keys = ("parameters",)

    def finish(self) -> list[Event]:
        # The grammar allows a list of calls alone: a call max_tokens cut before its name is
        # a piece of that list, not text the model wrote.
        self._read()
        if self._call is not None and not self._started:
            self._call = None
            self._mode = "separator"
        return super().finish()
