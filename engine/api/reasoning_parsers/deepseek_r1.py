"""DeepSeek-R1's format (R1, its distilled models, QwQ): the template opens the thought in
the prompt, so the output thinks from its first token (R1-0528 repeats `<think>`, which is
dropped) up to `</think>`; an output without `</think>` is all reasoning."""

from __future__ import annotations

from engine.api.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_thinking = True
