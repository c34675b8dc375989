"""A validated request body -> what the engine takes (prompt token ids, SamplingParams).

Every rejection is a 400 naming the request's own field (max_completion_tokens, not the
engine's max_tokens), checked before anything reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

from engine.api.errors import APIError
from engine.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseFormat,
    TokenizeRequest,
)
from engine.api.reasoning import ReasoningUse
from engine.api.tools import ToolUse
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutput


def prompt_param(request: CompletionRequest | ChatCompletionRequest, index: int) -> str:
    """The field the request's prompt `index` came in, as errors name it: `prompt`, or
    `prompt[1]` in a list of prompts; a chat's `messages`."""
    if isinstance(request, ChatCompletionRequest):
        return "messages"
    return f"prompt[{index}]" if request.several_prompts else "prompt"


def structured_output_param(
    request: CompletionRequest | ChatCompletionRequest, tools: ToolUse | None
) -> str:
    """The field a request's structured output came in, as errors name it."""
    if tools is not None and tools.structured_output is not None:
        return "tools"
    return "response_format" if request.structured_outputs is None else "structured_outputs"


def check_prompt(ids: list[int], max_model_len: int, param: str) -> list[int]:
    # The engine checks this too; here the message names the request's field.
    if not ids:
        raise APIError(f"{param} is empty", param=param)
    if len(ids) >= max_model_len:
        raise APIError(
            f"{param} is {len(ids)} tokens long; this model's max_model_len is "
            f"{max_model_len} tokens (prompt and output together)",
            param=param,
            code="context_length_exceeded",
        )
    return ids


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    max_tokens_field: str,
    logprobs: int | None,
    tools: ToolUse | None = None,
    reasoning: ReasoningUse | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """`max_tokens=None` means "up to max_model_len"; OpenAI's unset fields take `defaults`
    (the model's generation-config values) or else the engine's defaults. `tools`: what a
    chat's tools ask of the output; `reasoning`: with a reasoning parser, a structured
    output starts after the thought."""
    max_tokens = _checked_max_tokens(
        request, prompt_len, max_model_len, max_tokens, max_tokens_field
    )
    structured = _checked_structured_output(request, tools)
    if reasoning is not None:
        structured = reasoning.structured_output(structured)
    optional = _optional_fields(request, structured)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=_prompt_logprobs(request),
            skip_special_tokens=request.skip_special_tokens
            and not (tools is not None and tools.keeps_special_tokens),
            include_stop_str_in_output=request.include_stop_str_in_output,
            # A response sent whole needs only the final output: the engine sends no other.
            output_kind=RequestOutputKind.CUMULATIVE
            if request.stream
            else RequestOutputKind.FINAL_ONLY,
            **{k: v for k, v in (defaults or {}).items() if optional.get(k) is None},
            **{k: v for k, v in optional.items() if v is not None},
        )
    except ValueError as e:
        # SamplingParams names the field first: "temperature must be >= 0, got -1".
        raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None


def _checked_max_tokens(
    request: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    max_tokens_field: str,
) -> int:
    """The output's length in tokens, if the prompt leaves room for it."""
    room = max_model_len - prompt_len
    if echo_only(request):
        return 1  # the prompt's logprobs come with the first generated token
    if max_tokens is None:
        return room
    if max_tokens < 1:
        also = " (or 0 with echo=true)" if isinstance(request, CompletionRequest) else ""
        raise APIError(
            f"{max_tokens_field} must be >= 1{also}, got {max_tokens}", param=max_tokens_field
        )
    if max_tokens > room:
        raise APIError(
            f"{max_tokens_field}={max_tokens} is too large: the prompt has {prompt_len} "
            f"tokens and max_model_len is {max_model_len}, so at most {room} "
            f"tokens can be generated",
            param=max_tokens_field,
            code="context_length_exceeded",
        )
    return max_tokens


def _checked_structured_output(
    request: CompletionRequest | ChatCompletionRequest, tools: ToolUse | None
) -> StructuredOutput | None:
    """The request's structured output, if nothing else it asks for keeps the output from
    finishing where the structure does."""
    structured = _structured_output(request, tools)
    blocking_eos = [
        f
        for f, on in (("min_tokens", request.min_tokens), ("ignore_eos", request.ignore_eos))
        if on
    ]
    if blocking_eos and structured is not None:
        if tools is not None and tools.structured_output is not None:
            given = f"tool_choice {tools.choice!r}"
        else:
            given = structured_output_param(request, tools)
        # A finished value allows only EOS, which these would block or pass over.
        field = blocking_eos[0]
        raise APIError(f"{field} cannot be combined with {given}", param=field)
    return structured


def _optional_fields(
    request: CompletionRequest | ChatCompletionRequest, structured: StructuredOutput | None
) -> dict[str, Any]:
    """SamplingParams' fields a request may leave unset (None): those take the model's
    defaults, or else the engine's."""
    return {
        "n": request.n,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "logit_bias": _logit_bias(request.logit_bias),
        "allowed_token_ids": request.allowed_token_ids,
        "structured_output": structured,
    }


def echo_only(request: CompletionRequest | ChatCompletionRequest) -> bool:
    """OpenAI's legacy `max_tokens: 0` with `echo`: the prompt back (to score it), nothing
    generated."""
    return isinstance(request, CompletionRequest) and request.echo and request.max_tokens == 0


def _prompt_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Top-N per prompt token, for echo with logprobs and for vLLM's prompt_logprobs. Only
    then: they cost the prefix cache's hits (the whole prompt is computed)."""
    if not isinstance(request, CompletionRequest):
        return request.prompt_logprobs
    wanted = [request.prompt_logprobs, request.logprobs if request.echo else None]
    return max((n for n in wanted if n is not None), default=None)


def _structured_output(
    request: CompletionRequest | ChatCompletionRequest, tools: ToolUse | None
) -> StructuredOutput | None:
    from_format = _from_response_format(request.response_format)
    wanted = request.structured_outputs
    if tools is not None and tools.structured_output is not None:
        for field, given in (("response_format", from_format), ("structured_outputs", wanted)):
            if given is not None:
                raise APIError(
                    f"{field} cannot be combined with tool_choice {tools.choice!r}: the "
                    "output is then the tool calls' JSON",
                    param=field,
                )
        return tools.structured_output
    if wanted is None:
        return from_format
    if from_format is not None:
        raise APIError(
            "give response_format or structured_outputs, not both", param="structured_outputs"
        )
    given = {
        name: value
        for name, value in (
            ("json", wanted.json_),
            ("regex", wanted.regex),
            ("choice", wanted.choice),
            ("grammar", wanted.grammar),
            ("json_object", wanted.json_object or None),
        )
        if value is not None
    }
    if len(given) != 1:
        got = ", ".join(given) or "none"
        raise APIError(
            f"structured_outputs takes exactly one of json, regex, choice, grammar or "
            f"json_object, got {got}",
            param="structured_outputs",
        )
    ((name, value),) = given.items()
    if name == "json":
        value = value if isinstance(value, str) else json.dumps(value)
        name = "json_schema"
    try:
        return StructuredOutput() if name == "json_object" else StructuredOutput(**{name: value})
    except ValueError as e:
        raise APIError(str(e), param="structured_outputs") from None


def _from_response_format(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput()
    if response_format.json_schema is None:
        raise APIError(
            "response_format of type json_schema needs json_schema.schema",
            param="response_format",
        )
    return StructuredOutput(json.dumps(response_format.json_schema.schema_))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    return {_token_id_key(key): value for key, value in bias.items()}


_MAX_ID_DIGITS = len(str(2**63 - 1))


def _token_id_key(key: str) -> int:
    """A logit_bias key as a token id: ASCII digits only (int() also takes " 1 ", "1_0"
    and other scripts' digits). A '-' passes, for SamplingParams to refuse by its range."""
    digits = key.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        raise APIError(
            f"logit_bias keys must be token ids in decimal digits, got {key!r}",
            param="logit_bias",
        )
    num_digits = len(digits.lstrip("0"))
    if num_digits > _MAX_ID_DIGITS:
        # Past SamplingParams' int64 bound; int() would refuse past 4,300 digits.
        raise APIError(
            f"logit_bias token id must be in [0, {2**63 - 1}], got a {num_digits}-digit number",
            param="logit_bias",
        )
    return int(key)


def chat_messages(request: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """Messages as a chat template takes them ("developer" is OpenAI's new "system"); an
    assistant's tool calls keep their arguments as JSON text, which apply_chat_template
    decodes."""
    messages = []
    for i, m in enumerate(request.messages):
        _check_tool_fields(m, f"messages[{i}]")
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls is not None:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def _check_tool_fields(message: ChatMessage, where: str) -> None:
    if message.role == "tool" and message.tool_call_id is None:
        param = f"{where}.tool_call_id"
        raise APIError(f"{param} is required: the id of the call whose result this is", param=param)
    for field, role in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
        if getattr(message, field) is not None and message.role != role:
            param = f"{where}.{field}"
            raise APIError(f"{param} belongs to {role} messages only", param=param)
