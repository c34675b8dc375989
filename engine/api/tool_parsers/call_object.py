"""One tool call's JSON object, `{"name": "f", "arguments": {...}}`, read as it arrives.

The reader keeps only what it needs to stream the call: where it is in the object's
grammar, the name once its string has closed, and the arguments text (the object's value
as the model wrote it) as it comes. Every top-level value is checked with `json.loads`
when it closes, so a call whose arguments are not valid JSON fails by the time they end.
"""

from __future__ import annotations

import json
from enum import Enum, auto

_WHITESPACE = " \t\n\r"


class _At(Enum):
    OPEN = auto()
    """Before the object's `{`."""
    FIRST_KEY = auto()
    """After `{`: a key, or `}`."""
    KEY = auto()
    """After `,`: a key."""
    IN_KEY = auto()
    COLON = auto()
    VALUE = auto()
    """Before a value's first character."""
    IN_VALUE = auto()
    IN_SCALAR = auto()
    """A number, true, false or null, which ends at the next delimiter."""
    AFTER_VALUE = auto()
    DONE = auto()
    FAILED = auto()


class CallObject:
    """Feed it text; it takes characters until its object ends (or turns out not to be a
    call: `failed`). `name` is set once known; `take_arguments()` hands out the arguments
    text read since the last call."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.arguments_keys = arguments_keys
        self.raw = ""
        """Every character taken so far."""
        self.name: str | None = None
        self._at = _At.OPEN
        self._key_start = 0
        self._key = ""
        self._value_start = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._seen_arguments = False
        self._arguments = []

    @property
    def done(self) -> bool:
        return self._at is _At.DONE

    @property
    def failed(self) -> bool:
        return self._at is _At.FAILED

    def fail(self) -> None:
        """The text ended before the object did."""
        self._at = _At.FAILED

    def take_arguments(self) -> str:
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def feed(self, text: str) -> int:
        """How many characters of `text` the object took: all of them, or those up to its
        closing `}` (done) or up to the first that no call could have (failed)."""
        start = len(self.raw)
        self.raw += text
        i = start
        streamed_from = start if self._at is _At.IN_VALUE and self._in_arguments else None
        while i < len(self.raw) and self._at not in (_At.DONE, _At.FAILED):
            entering = self._at is _At.VALUE
            i = self._step(i)
            if entering and self._at is _At.IN_VALUE and self._in_arguments:
                streamed_from = i - 1
            if streamed_from is not None and self._at is not _At.IN_VALUE:
                self._arguments.append(self.raw[streamed_from:i])
                streamed_from = None
        if streamed_from is not None:
            self._arguments.append(self.raw[streamed_from:i])
        self.raw = self.raw[:i]
        return i - start

    @property
    def _in_arguments(self) -> bool:
        return self._key in self.arguments_keys

    def _step(self, i: int) -> int:
        """Take the character at i (a scalar's delimiter is left for the next state); the
        index of the next one to read."""
        c = self.raw[i]
        at = self._at
        if at is _At.IN_VALUE:
            return self._value_char(i, c)
        if at is _At.IN_KEY:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._key = _loads(self.raw[self._key_start : i + 1])
                self._at = _At.COLON if isinstance(self._key, str) else _At.FAILED
            return i + 1
        if at is _At.IN_SCALAR:
            if c in _WHITESPACE or c in ",}":
                self._close_value(i)
                return i
            return i + 1
        if c in _WHITESPACE:
            return i + 1
        if at is _At.OPEN:
            self._at = _At.FIRST_KEY if c == "{" else _At.FAILED
        elif at in (_At.FIRST_KEY, _At.KEY) and c == '"':
            self._at, self._key_start = _At.IN_KEY, i
        elif at is _At.FIRST_KEY and c == "}":
            self._end_object()
        elif at is _At.COLON:
            self._at = _At.VALUE if c == ":" else _At.FAILED
        elif at is _At.VALUE:
            self._start_value(i, c)
        elif at is _At.AFTER_VALUE and c in ",}":
            if c == "}":
                self._end_object()
            else:
                self._at = _At.KEY
        else:
            self._at = _At.FAILED
        return i if self._at is _At.FAILED else i + 1

    def _start_value(self, i: int, c: str) -> None:
        self._value_start = i
        if self._in_arguments and (c != "{" or self._seen_arguments):
            self._at = _At.FAILED  # arguments are one object
        elif c in "{[":
            self._at, self._depth = _At.IN_VALUE, 1
        elif c == '"':
            self._at, self._depth, self._in_string = _At.IN_VALUE, 0, True
        else:
            self._at = _At.IN_SCALAR

    def _value_char(self, i: int, c: str) -> int:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self._depth == 0:
                    self._close_value(i + 1)
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._close_value(i + 1)
        return i + 1

    def _close_value(self, end: int) -> None:
        try:
            value = json.loads(self.raw[self._value_start : end])
        except ValueError:
            self._at = _At.FAILED
            return
        self._at = _At.AFTER_VALUE
        if self._key == "name":
            if not isinstance(value, str) or not value or self.name is not None:
                self._at = _At.FAILED
            else:
                self.name = value
        elif self._in_arguments:
            self._seen_arguments = True

    def _end_object(self) -> None:
        if self.name is None:
            self._at = _At.FAILED
            return
        self._at = _At.DONE
        if not self._seen_arguments:
            self._arguments.append("{}")


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
