"""A chat request's tools: checked, and what they ask of the output (`ToolUse`).

tool_choice "none" leaves the output text. A named function or "required" constrains the
output with a grammar, to the function's arguments or to a JSON list of calls, so any model
makes them. "auto" (the default with tools) reads calls out of free text with the server's
tool_call_parser, the model's own format. Whatever tool_choice is, the tools reach the chat
template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from jsonschema import SchemaError, validators

from engine.api.errors import APIError
from engine.api.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from engine.api.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser
from engine.sampling_params import StructuredOutput
from engine.structured_output import SCHEMA_MAPS, unenforced_keyword

_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""The function names OpenAI's API takes."""
_NO_ARGUMENTS = {"type": "object", "additionalProperties": False}
"""A function without parameters takes `{}`."""

_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
"""Keywords whose values are JSON data, where a "$ref" key refers to nothing."""
_NAMED_SCHEMAS = SCHEMA_MAPS | {"dependentSchemas", "dependencies"}
"""Keywords whose values map names to schemas: SCHEMA_MAPS and two that are refused later,
by name (the grammar cannot enforce them)."""


@dataclass(frozen=True)
class ToolUse:
    """How a request's output becomes tool calls."""

    choice: Literal["named", "required", "auto"]
    new_parser: Callable[[], ToolParser]
    parallel: bool
    """parallel_tool_calls: false keeps the first call alone."""
    new_call_id: Callable[[], str]
    structured_output: StructuredOutput | None = None
    """The grammar of a named or required choice's output."""
    eos_text: str | None = None
    """Where the parser keeps special tokens in the text (its marker is one): the end of
    sequence token's text, left out of what it reads."""

    @property
    def keeps_special_tokens(self) -> bool:
        return self.eos_text is not None

    def visible(self, text: str, finish_reason: str | None) -> str:
        """The part of the output's text (or of its last delta) the parser reads."""
        if self.eos_text and finish_reason == "stop":
            return text.removesuffix(self.eos_text)
        return text

    def finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" for an output that ended in calls, except a named choice's
        ("stop"); a cut-short output stays "length"."""
        if called and finish_reason == "stop" and self.choice != "named":
            return "tool_calls"
        return finish_reason


def check_tools(tools: list[ChatTool] | None) -> None:
    """Unique names of OpenAI's form; parameters that are a JSON schema of an object."""
    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        name = tool.function.name
        param = f"tools[{i}].function.name"
        if not _FUNCTION_NAME.fullmatch(name):
            raise APIError(
                f"{param}: {name!r} is not a function name: 1 to 64 letters, digits, "
                f"underscores or dashes ({_FUNCTION_NAME.pattern})",
                param=param,
            )
        if name in names:
            raise APIError(f"{param}: {name!r} names an earlier tool too", param=param)
        names.add(name)
        if tool.function.parameters is not None:
            _check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape, fields not given left out)."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def tool_use(
    request: ChatCompletionRequest,
    parser: type[ToolParser] | None,
    auto_enabled: bool,
    tokenizer: Any,
) -> ToolUse | None:
    """What the request's tools ask of its output (None: nothing, the output is text).
    `parser`: the server's tool_call_parser, which "auto" needs (with `auto_enabled`)."""
    tools = request.tools or None
    choice = "auto" if tools and request.tool_choice is None else request.tool_choice
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(
                "tool_choice needs tools: the functions the model may call", param="tool_choice"
            )
        return None
    if choice == "none":
        return None
    new_call_id = (parser or ToolParser).new_call_id
    parallel = request.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        schema = _grammar_parameters(tools, _named_tool(tools, choice), "#")
        return ToolUse(
            "named",
            partial(NamedToolParser, choice.function.name),
            parallel,
            new_call_id,
            StructuredOutput(json.dumps(schema)),
        )
    if choice == "required":
        schema = _calls_schema(tools, parallel)
        return ToolUse(
            "required",
            RequiredToolParser,
            parallel,
            new_call_id,
            StructuredOutput(json.dumps(schema)),
        )
    if parser is None or not auto_enabled:
        raise APIError(
            'tool_choice "auto" (the default with tools) needs a server that reads its '
            "model's calls: start it with enable_auto_tool_choice and a tool_call_parser "
            "(kvray serve --enable-auto-tool-choice --tool-call-parser hermes), or send "
            'tool_choice "none", "required" or a named function',
            param="tool_choice",
        )
    keeps = parser.special_marker is not None and _is_special(tokenizer, parser.special_marker)
    return ToolUse(
        "auto", parser, parallel, new_call_id, eos_text=tokenizer.eos_token if keeps else None
    )


def _named_tool(tools: list[ChatTool], choice: NamedToolChoice) -> int:
    for i, tool in enumerate(tools):
        if tool.function.name == choice.function.name:
            return i
    names = ", ".join(repr(t.function.name) for t in tools)
    param = "tool_choice.function.name"
    raise APIError(
        f"{param}: {choice.function.name!r} is not one of the tools ({names})", param=param
    )


def _calls_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls `{"name": ..., "parameters": ...}`, each to one of the tools with
    its schema. Each tool's parameters sit whole in the root's `$defs` (as `tool0`, ...), their
    `$ref`s rewritten to start there, so each points where it did in the tool's own schema."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        key = f"tool{i}"
        defs[key] = _grammar_parameters(tools, i, f"#/$defs/{key}")
        # An `$id` there would resolve the refs, now from the document's root, against it.
        defs[key].pop("$id", None)
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": {"$ref": f"#/$defs/{key}"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": calls},
        "$defs": defs,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _grammar_parameters(tools: list[ChatTool], index: int, root: str) -> dict[str, Any]:
    """Tool `index`'s parameters for a grammar that holds them at JSON pointer `root`."""
    parameters = tools[index].function.parameters or _NO_ARGUMENTS
    param = f"tools[{index}].function.parameters"
    unenforced = unenforced_keyword(parameters)
    if unenforced is not None:
        raise APIError(
            f'{param}: {unenforced}, which the grammar of a named tool_choice or "required" '
            "would not enforce",
            param=param,
        )
    return _rebased(parameters, root, param)


def _rebased(schema: Any, root: str, param: str) -> Any:
    """A copy of `schema` whose `$ref`s point from `root` (where the schema now sits) rather
    than from the schema's own root. The grammar follows JSON pointers alone ("#", "#/..."):
    any other ref (a URL, an anchor, one relative to an `$id`) is an APIError."""
    if isinstance(schema, list):
        return [_rebased(item, root, param) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            rebased[key] = _rebased_ref(value, root, param)
        elif key in _DATA_KEYWORDS:
            rebased[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            rebased[key] = {name: _rebased(sub, root, param) for name, sub in value.items()}
        else:
            rebased[key] = _rebased(value, root, param)
    return rebased


def _rebased_ref(ref: str, root: str, param: str) -> str:
    if ref != "#" and not ref.startswith("#/"):
        raise APIError(
            f'{param}: $ref {ref!r} is not a JSON pointer into these parameters ("#" or '
            '"#/..."), the only references a named tool_choice or "required" can follow',
            param=param,
        )
    return root + ref[1:]


def _check_parameters(schema: dict[str, Any], param: str) -> None:
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        # jsonschema looks the dialect up by its URI and fails on anything else.
        raise APIError(
            f"{param}.$schema must be a URI string, got {type(dialect).__name__}",
            param=f"{param}.$schema",
        )
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise APIError(f"{param} is not a valid JSON schema: {e.message}", param=param) from None
    types = schema.get("type", "object")
    if "object" not in ([types] if isinstance(types, str) else types):
        raise APIError(
            f'{param} must describe an object (type "object"), got type {types!r}', param=param
        )


def _is_special(tokenizer: Any, text: str) -> bool:
    """`text` is a special token: decoding skips it unless told to keep special tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return any(token.content == text and token.special for token in added.values())
