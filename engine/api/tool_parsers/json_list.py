"""Calls as one JSON list, `[{"name": ..., "arguments": {...}}, ...]`, after a marker where
the format has one; text before the marker and after the list is content."""

from __future__ import annotations

from engine.api.tool_parsers.base import ToolParser, read_until


class JSONListToolParser(ToolParser):
    marker: str | None = None
    """Text that opens the list (None: the output starts with it)."""
    after_call = "separator"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "text" if self.marker is not None else "open"
        self._list_opening = ""

    def _read_outside(self) -> bool:
        if self._mode == "text":
            return self._read_text()
        space, stripped = self._split_space()
        if not stripped:
            return False
        if self._mode == "open" and stripped[0] == "[":
            self._pending = stripped[1:]
            self._begin_call(self._list_opening + space + "[")
        elif self._mode == "open":
            self._content(self._list_opening)
            self._mode = "text"
        elif stripped[0] == ",":
            self._pending = stripped[1:]
            self._begin_call(space + ",")
        else:
            if stripped[0] == "]":
                self._pending = stripped[1:]
            self._mode = "text"
        return True

    def _read_text(self) -> bool:
        if self.marker is None:
            self._content(self._pending)
            self._pending = ""
            return False
        before, after = read_until(self._pending, self.marker)
        self._content(before)
        if after is None:
            self._pending = self._pending[len(before) :]
            return False
        self._pending = after
        self._list_opening = self.marker
        self._mode = "open"
        return True

    def _end(self) -> None:
        if self._mode == "open":
            self._content(self._list_opening)
        elif self._mode == "separator":
            self._pending = ""  # a list cut short after a whole call
        super()._end()
