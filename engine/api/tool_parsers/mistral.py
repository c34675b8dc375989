"""Mistral's format: `[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": {...}}`.

`[TOOL_CALLS]` is a special token in Mistral's tokenizers, so requests parsed this way keep
special tokens in their text (as vLLM does); call ids are 9 letters and digits, the only
ids Mistral's chat templates accept."""

from __future__ import annotations

import secrets
import string

from engine.api.tool_parsers.json_list import JSONListToolParser

TOOL_CALLS = "[TOOL_CALLS]"


_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(JSONListToolParser):
    marker = TOOL_CALLS
    special_marker = TOOL_CALLS

    @staticmethod
    def new_call_id() -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
