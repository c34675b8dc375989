"""OpenAI's HTTP protocol as pydantic models: requests are validated strictly (wrong types,
unknown fields and out-of-range values are 400s naming the field), responses are built
from these models so every front end serializes the same shapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from engine.sampling_params import MAX_LOGPROBS


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's error body."""

    _TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        408: "TimeoutError",
        413: "BadRequestError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
    }

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple:
        # Crosses process boundaries (Serve replicas) with its status intact.
        return (
            APIError,
            (self.message, self.status_code, self.param, self.code, self.retry_after_s),
        )

    def to_response(self) -> ErrorResponse:
        # A client error never reads as the server's fault, named or not.
        fallback = "InvalidRequestError" if self.status_code < 500 else "InternalServerError"
        err_type = self._TYPES.get(self.status_code, fallback)
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=err_type, param=self.param, code=self.code)
        )

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after_s)))}


def quoted_names(names: Iterable[str]) -> str:
    """`a`, `b`: model names as error messages list them."""
    return ", ".join(f"`{name}`" for name in names)


def model_not_found(model: str, served: Iterable[str]) -> APIError:
    """OpenAI's 404 for a model this server does not serve, naming those it does."""
    return APIError(
        f"The model `{model}` does not exist (this server serves {quoted_names(served)})",
        404,
        param="model",
        code="model_not_found",
    )


def validation_error(e: ValidationError) -> APIError:
    """400 for the first problem pydantic found, naming the field (`messages[0].role`)."""
    errors = e.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return APIError(f"the request body is not valid JSON: {errors[0]['msg']}")
    problem = _first_problem(errors)
    param = _format_loc(tuple(problem[0]["loc"]))
    if problem[0]["type"] == "missing":
        return APIError(f"{param} is required", param=param)
    if problem[0]["type"] == "extra_forbidden":
        return APIError(f"{param} is not a supported field", param=param)
    msg = " or ".join(dict.fromkeys(err["msg"] for err in problem))
    return APIError(f"{param}: {msg}", param=param)


def _first_problem(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first error, or where it lies in a union, the errors of the member that best fits.

    A union reports one error per member, each with the member's tag in its loc. The member
    that read furthest into the value before its first error is the one the client meant
    (`[1, "a"]` is a list[int] failing at [1], not a str); members tied for furthest, such as
    `str` and `list[...]` both refusing a number, are reported together.
    """
    first = errors[0]
    searched = 0
    while (tag_at := _union_tag_index(first["loc"], searched)) is not None:
        members = _first_error_per_member(errors, tuple(first["loc"][:tag_at]), tag_at)
        furthest = max(_reach(err["loc"][tag_at + 1 :]) for err in members)
        fits = [err for err in members if _reach(err["loc"][tag_at + 1 :]) == furthest]
        if len(fits) > 1:
            return fits
        first = fits[0]
        member_loc = tuple(first["loc"][: tag_at + 1])
        errors = [err for err in errors if tuple(err["loc"][: tag_at + 1]) == member_loc]
        searched = tag_at + 1
    return [first]


def _union_tag_index(loc: tuple, start: int) -> int | None:
    return next((i for i in range(start, len(loc)) if _is_union_tag(loc[i])), None)


def _first_error_per_member(
    errors: list[dict[str, Any]], union_loc: tuple, tag_at: int
) -> list[dict[str, Any]]:
    firsts: dict[str, dict[str, Any]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        if len(loc) > tag_at and loc[:tag_at] == union_loc and _is_union_tag(loc[tag_at]):
            firsts.setdefault(loc[tag_at], err)
    return list(firsts.values())


def _reach(loc_in_member: tuple) -> tuple[int, ...]:
    # Later list items and deeper fields are further in; field names rank alike.
    return tuple(part if isinstance(part, int) else 0 for part in loc_in_member)


def _is_union_tag(part: object) -> bool:
    # Field names are snake_case; member tags are types: "str", "list[int]", "TextContentPart".
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()
    )


def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if _is_union_tag(part):
            continue  # the union member the value was read as
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries the usage so far."""


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    """Output always follows the schema, strict or not."""


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's structured_outputs: one of a JSON schema (an object, or its text), a regular
    expression, a choice of strings, an EBNF grammar (xgrammar's dialect, start rule
    `root`), or any JSON object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Fields both endpoints share: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    """None: the only model served."""
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token ids (as JSON object keys) -> a bias in [-100, 100]."""
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int | None = None
    """Scheduling priority (lower runs first); never more urgent than the tenant's own."""
    cache_salt: str | None = Field(default=None, min_length=1)
    """vLLM's: the prompt's cached blocks are shared only with requests of the same salt
    (within the tenant's own)."""
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    """vLLM's: sample only these tokens."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """vLLM's: keep only the prompt's last N tokens (-1: as many as max_model_len allows)."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name tokens "token_id:<id>" instead of by their text."""
    return_token_ids: bool = False
    """vLLM's: the prompt's and each choice's token ids beside the text (streamed: the
    prompt's on the first chunk, each chunk's new tokens)."""
    response_format: ResponseFormat | None = None
    """OpenAI's: free text, any JSON object, or JSON that follows a schema."""
    structured_outputs: StructuredOutputsParams | None = None
    """vLLM's: the output follows a JSON schema, a regex, a choice or a grammar."""

    @field_validator("stream_options")
    @classmethod
    def _stream_options_only_when_streaming(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # `stream` is declared, so validated, first; one that failed is reported on its own.
        if options is not None and not info.data.get("stream", True):
            raise PydanticCustomError(
                "stream_options_without_stream", "only allowed when `stream` is true"
            )
        return options


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    """Each choice starts with its prompt (with logprobs: the prompt tokens' too); with
    max_tokens=0, the prompt alone."""
    best_of: int | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each choice carries the top-N logprobs of every prompt token."""
    add_special_tokens: bool = True
    """vLLM's: a text prompt gets the tokenizer's special tokens (a Llama 3's BOS)."""


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallParam(_Request):
    name: str
    arguments: str
    """The call's arguments as JSON text (an object)."""


class ToolCallParam(_Request):
    """A call an earlier assistant message made."""

    id: str
    type: Literal["function"]
    function: FunctionCallParam


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """A tool message's: the id of the call whose result it carries."""


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (an object); None: no arguments."""
    strict: bool | None = None
    """Calls chosen by tool_choice follow the schema, strict or not."""


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("NamedToolChoice")],
    # An object is read as a named choice only: its errors then name its own fields.
    Discriminator(
        lambda value: "NamedToolChoice" if isinstance(value, dict | BaseModel) else "str"
    ),
]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the model continues the last message (with add_generation_prompt false)."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: the response carries the top-N logprobs of every prompt token (not streamed)."""
    tools: list[ChatTool] | None = None
    """Functions the model may call: they reach the chat template whatever tool_choice is."""
    tool_choice: ToolChoice | None = None
    """None: "auto" with tools, else "none" (OpenAI's defaults)."""
    parallel_tool_calls: bool = True
    """False: one call at most."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template (e.g. Qwen3's `enable_thinking`),
    over the server's default_chat_template_kwargs."""
    add_special_tokens: bool = False
    """vLLM's: the tokenizer's special tokens on top of what the chat template writes
    (most templates write the BOS themselves)."""


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt as a completion takes it, or messages as a chat does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ChatTool] | None = None
    """As a chat's: rendered into the prompt by the chat template."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the model continues the last message (with add_generation_prompt false)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """As a chat's: extra variables for the chat template."""
    add_special_tokens: bool | None = None
    """As the endpoint's: None is true for a prompt, false for messages."""
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class CompletionLogprobs(_Response):
    """An echoed prompt's first token has no logprob: null in token_logprobs and top_logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One candidate at a prompt position, as vLLM's prompt_logprobs lists it."""

    logprob: float
    rank: int
    """1 = the most likely token."""
    decoded_token: str


def _is_none(value: Any) -> bool:
    return value is None


def _left_out_while_none() -> Any:
    """A field that stays out of the JSON while None: what a request did not ask for is not
    there, as in OpenAI's and vLLM's bodies. (Per field, so serialization stays in
    pydantic's core: a model serializer in Python made a chat chunk 2.6x slower to write.)"""
    return Field(default=None, exclude_if=_is_none)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = _left_out_while_none()
    """OpenAI's; on a server started with enable_prompt_tokens_details (vLLM's key)."""


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = _left_out_while_none()
    """vLLM's: per prompt token (None for the first), token id -> its logprob, for the prompt
    token and the top-N."""
    prompt_token_ids: list[int] | None = _left_out_while_none()
    """vLLM's, with return_token_ids (streamed: on the choice's first chunk)."""
    token_ids: list[int] | None = _left_out_while_none()
    """vLLM's, with return_token_ids: the generated ids (streamed: those new in the chunk)."""


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """None when the output was tool calls alone (or, with a reasoning parser, a thought
    alone)."""
    reasoning: str | None = _left_out_while_none()
    """vLLM's, with a reasoning_parser: the model's thought (between <think> and </think>)."""
    reasoning_content: str | None = _left_out_while_none()
    """vLLM's older name of `reasoning`, sent beside it."""
    tool_calls: list[ToolCall] | None = _left_out_while_none()


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _left_out_while_none()
    """vLLM's, with return_token_ids: the generated ids, stop token included."""


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = _left_out_while_none()
    """vLLM's, as on a completion's choice."""
    prompt_token_ids: list[int] | None = _left_out_while_none()
    """vLLM's, with return_token_ids."""


class ChatChunkChoice(_Response):
    index: int
    delta: dict[str, Any]
    """{"role": "assistant", "content": ""} first, then {"content": ...} (or {"tool_calls":
    [...]}: on a call's first delta its index, id, type and name, then its index and
    arguments text; with a reasoning parser, {"reasoning": ..., "reasoning_content": ...}
    while the model thinks), then {} with the finish reason."""
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _left_out_while_none()
    """vLLM's, with return_token_ids: the ids generated since the choice's last chunk."""


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _left_out_while_none()
    """vLLM's, with return_token_ids: on the stream's first chunk."""


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvray"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
