"""Llama 3.1/3.2's JSON calls: the output is `{"name": ..., "parameters": {...}}`, several
separated by `;`, optionally after `<|python_tag|>` (a special token: skipped from the text
by default). An output that starts otherwise is content."""

from __future__ import annotations

from engine.api.tool_parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    arguments_keys = ("parameters", "arguments")
    after_call = "separator"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"

    def _read_outside(self) -> bool:
        space, stripped = self._split_space()
        if self._mode == "text":
            self._content(self._pending)
            self._pending = ""
        elif self._mode == "start" and stripped.startswith(PYTHON_TAG):
            self._pending = stripped[len(PYTHON_TAG) :]
            self._begin_call(space + PYTHON_TAG)
        elif self._mode == "start" and stripped.startswith("{"):
            self._pending = stripped
            self._begin_call(space)
        elif self._mode == "separator" and stripped.startswith(";"):
            self._pending = stripped[1:]
            self._begin_call(space + ";")
        elif not stripped or (self._mode == "start" and PYTHON_TAG.startswith(stripped)):
            return False
        else:
            self._mode = "text"
        return True

    def _end(self) -> None:
        if self._mode == "separator":
            self._pending = ""  # whitespace after the last call
        super()._end()
