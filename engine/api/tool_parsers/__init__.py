"""Tool-call parsers: a model's output text -> content and calls, whole or as it streams.

`TOOL_CALL_PARSERS` holds the formats `tool_call_parser` names (vLLM's names)."""

from engine.api.tool_parsers.base import (
    CallArguments,
    CallBroken,
    CallStart,
    Content,
    Event,
    ToolParser,
)
from engine.api.tool_parsers.forced import NamedToolParser, RequiredToolParser
from engine.api.tool_parsers.hermes import HermesToolParser
from engine.api.tool_parsers.llama3_json import Llama3JsonToolParser
from engine.api.tool_parsers.mistral import MistralToolParser
from engine.api.tool_parsers.reading import ExtractedToolCalls, ToolCallStream, extract_tool_calls

TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

__all__ = [
    "TOOL_CALL_PARSERS",
    "CallArguments",
    "CallBroken",
    "CallStart",
    "Content",
    "Event",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "RequiredToolParser",
    "ToolCallStream",
    "ToolParser",
    "extract_tool_calls",
]
