"""Qwen3's format: the model opens its thought with `<think>` (or the template did, at the
prompt's end) and ends it with `</think>`; an output that opens none is all content, as is
every output of a prompt that ended the thought already (`enable_thinking: false`)."""

from __future__ import annotations

from engine.api.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    starts_thinking = False
