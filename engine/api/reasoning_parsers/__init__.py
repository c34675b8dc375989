"""Reasoning parsers: a model's output text -> its reasoning and its content, whole or as it
streams.

`REASONING_PARSERS` holds the formats `reasoning_parser` names (vLLM's names)."""

from engine.api.reasoning_parsers.base import (
    END,
    START,
    PromptReasoning,
    ReasoningDelta,
    ReasoningParser,
    extract_reasoning,
    prompt_reasoning,
)
from engine.api.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from engine.api.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}

__all__ = [
    "END",
    "REASONING_PARSERS",
    "START",
    "DeepSeekR1ReasoningParser",
    "PromptReasoning",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "extract_reasoning",
    "prompt_reasoning",
]
