"""A reasoning model's output split into its thinking (between `<think>` and `</think>`)
and the rest, whole or as it streams.

A parser is fed the output text as it arrives and answers with a `ReasoningDelta`: the
new reasoning text and the new content text. A tag split across deltas is held back until
the next text tells; the split depends only on the text, never on how it was cut, so a
stream and a whole response agree.

Where the output starts (inside a thought or not) comes from the format and from the
prompt's tail (`prompt_reasoning`): a template that opens the thought in the prompt
(`...<think>\\n`) starts the output inside it, one that closes it there (Qwen3 with
`enable_thinking: false`: `<think>\\n\\n</think>\\n\\n`) leaves the output all content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.api.tool_parsers.base import read_until

START = "<think>"
END = "</think>"

PromptReasoning = Literal["open", "ended"] | None
"""What the prompt did to the thought: opened it, ended it, or neither."""


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def prompt_reasoning(prompt_tail: str) -> PromptReasoning:
    """Whether the prompt's last text opened a thought or ended one."""
    tail = prompt_tail.rstrip()
    if tail.endswith(END):
        return "ended"
    if tail.endswith(START):
        return "open"
    return None


class ReasoningParser:
    """Subclasses set `starts_thinking`: the output is a thought from its first character
    (a leading `<think>` is dropped), or only when it opens with `<think>`. Either way the
    thought ends at `</think>`, and one the output never ends is all reasoning (a thought
    cut short)."""

    starts_thinking = True

    def __init__(self, prompt: PromptReasoning = None) -> None:
        self._pending = ""
        if prompt == "ended":
            self._mode = "content"
        elif prompt == "open" or self.starts_thinking:
            self._mode = "opening"  # a thought, which may still repeat its <think>
        else:
            self._mode = "maybe"  # content, unless it opens with <think>

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        return self._read(final=False)

    def finish(self) -> ReasoningDelta:
        return self._read(final=True)

    def _read(self, final: bool) -> ReasoningDelta:
        reasoning = content = ""
        while True:
            if self._mode == "content":
                content += self._pending
                self._pending = ""
                break
            if self._mode == "thinking":
                before, after = read_until(self._pending, END)
                reasoning += before
                if after is None:
                    self._pending = self._pending[len(before) :]
                    if final:
                        reasoning += self._pending
                        self._pending = ""
                    break
                self._pending = after
                self._mode = "content"
                continue
            # "opening" / "maybe": the output's start, whitespace included, may be <think>.
            stripped = self._pending.lstrip()
            if stripped.startswith(START):
                self._pending = stripped[len(START) :]
                self._mode = "thinking"
            elif not final and len(stripped) < len(START) and START.startswith(stripped):
                break  # whitespace, or <think> begun: wait for more
            else:
                self._mode = "thinking" if self._mode == "opening" else "content"
        return ReasoningDelta(reasoning, content)


def extract_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output, each None when empty."""
    fed, ended = parser.feed(text), parser.finish()
    reasoning = fed.reasoning + ended.reasoning
    content = fed.content + ended.content
    return reasoning or None, content or None
