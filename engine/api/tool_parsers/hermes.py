"""Hermes' format (Hermes 2/3, Qwen2.5, Qwen3): each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, any number of
them, the text around them content."""

from __future__ import annotations

from engine.api.tool_parsers.base import ToolParser, read_until

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    after_call = "close"

    def _read_outside(self) -> bool:
        if self._mode == "text":
            before, after = read_until(self._pending, OPEN)
            self._content(before)
            if after is None:
                self._pending = self._pending[len(before) :]
                return False
            self._pending = after
            self._begin_call(OPEN)
            return True
        _, stripped = self._split_space()
        if stripped.startswith(CLOSE):
            self._pending = stripped[len(CLOSE) :]
        elif CLOSE.startswith(stripped):
            return False  # whitespace, or the closing tag begun
        self._mode = "text"  # closed, or a call without its closing tag: text follows
        return True

    def _end(self) -> None:
        if self._mode == "close":
            self._pending = ""  # what began a closing tag
        super()._end()
