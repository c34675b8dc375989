"""OpenAI's response bodies as pydantic models: every front end serializes the same
shapes (fields a request did not ask for stay out of the JSON)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


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
    quantization: str = "none"
    """How the model's weights run: none (16-bit), fp8, awq, gptq, gguf, compressed-tensors."""


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
