"""What a tool parser tells of a model's output, and the reading every format shares.

A parser is fed the output text as it arrives and answers with events: `Content` for
text outside calls, `CallStart` once a call's name is known, `CallArguments` for its
arguments text as it comes, `CallBroken` when a started call turns out not to be valid
JSON. The events depend only on the text, never on how it was split, so a stream and a
whole response read the same calls.

A started call that the output's end cuts short (max_tokens) is no broken call: it stays a
call, its arguments as far as they came, as OpenAI and vLLM's streams show it (a stream
cannot take back a call it has sent; finish_reason "length" tells the call is unfinished).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine.api.tool_parsers.call_object import CallObject


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


@dataclass(frozen=True)
class CallBroken:
    """Call `index` is not a call after all; `raw` is its text (a whole response shows it
    as content; a stream has sent the call already)."""

    index: int
    raw: str


Event = Content | CallStart | CallArguments | CallBroken


class ToolParser:
    """Subclasses read their format outside calls in `_read_outside()`, taking text from
    `self._pending` as far as it is decided, and `_end()` (the output ended). `_mode` is
    "call" while a call is read, then `after_call` (or "text" after a broken call)."""

    after_call = "text"

    arguments_keys: tuple[str, ...] = ("arguments",)
    special_marker: str | None = None
    """The format's marker, where a model's tokenizer has it as a special token: its
    requests keep special tokens in their text."""

    def __init__(self) -> None:
        self._pending = ""
        self._events: list[Event] = []
        self._num_calls = 0
        self._call: CallObject | None = None
        self._opening = ""
        self._started = False
        self._mode = "text"

    @staticmethod
    def new_call_id() -> str:
        """vLLM's call ids."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        self._read()
        return self._take()

    def finish(self) -> list[Event]:
        self._read()
        if self._call is not None and self._started:
            self._call = None  # cut short: a call all the same
            self._num_calls += 1
        elif self._call is not None:
            self._call.fail()  # cut short before its name: text
            self._end_call()
        self._end()
        return self._take()

    def _read(self) -> None:
        while self._pending:
            if self._mode == "call":
                ended = self._read_call()
                if ended == "reading":
                    return
                self._mode = self.after_call if ended == "done" else "text"
            elif not self._read_outside():
                return

    def _read_outside(self) -> bool:
        """Read pending text in the current mode; False when more text must come first."""
        raise NotImplementedError

    def _split_space(self) -> tuple[str, str]:
        """(the pending text's leading whitespace, the rest)."""
        stripped = self._pending.lstrip()
        return self._pending[: len(self._pending) - len(stripped)], stripped

    def _end(self) -> None:
        self._content(self._pending)
        self._pending = ""

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], Content):
            self._events[-1] = Content(self._events[-1].text + text)
        else:
            self._events.append(Content(text))

    def _begin_call(self, opening: str) -> None:
        """A call starts after `opening` (its marker, taken from the text already)."""
        self._call = CallObject(self.arguments_keys)
        self._opening = opening
        self._started = False
        self._mode = "call"

    def _read_call(self) -> str:
        """Feed the pending text to the call: "reading" (it goes on), "done" or "failed"."""
        call = self._call
        self._pending = self._pending[call.feed(self._pending) :]
        # Told when the name is known even if the text fed with it breaks the call: events
        # depend on the text alone, not on where it was split.
        if not self._started and call.name is not None:
            self._started = True
            self._events.append(CallStart(self._num_calls, call.name))
        if self._started:
            arguments = call.take_arguments()
            if arguments:
                self._events.append(CallArguments(self._num_calls, arguments))
        if not (call.done or call.failed):
            return "reading"
        self._end_call()
        return "failed" if call.failed else "done"

    def _end_call(self) -> None:
        call, self._call = self._call, None
        if call.failed:
            raw = self._opening + call.raw
            if self._started:
                self._events.append(CallBroken(self._num_calls, raw))
            else:
                self._content(raw)
        if self._started:
            self._num_calls += 1


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker`: text to hold back
    until the next characters tell."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def read_until(text: str, marker: str) -> tuple[str, str | None]:
    """(text before `marker`, text after it), or where it is not (yet) there, (text that
    cannot be part of it, None); what is neither is still to be decided."""
    found = text.find(marker)
    if found != -1:
        return text[:found], text[found + len(marker) :]
    return text[: len(text) - held_prefix(text, marker)], None
