"""OpenAI endpoints over an `AsyncEngine`, independent of the web framework.

`OpenAIServing` is what a front end holds: one `ServedModel` (served_model.py) shared by the
endpoint handlers, each in its own module:

    serving_base.py           the request path chat and completions share
    serving_chat.py           /v1/chat/completions
    serving_completion.py     /v1/completions
    serving_tokenization.py   /tokenize, /detokenize

`create_completion` / `create_chat_completion` return a response model, or for
`stream=True` an `SSEStream` of ready-to-send SSE text, as soon as the engine has taken the
request (its response can start while the prompt is computed). Anything wrong before that
raises `APIError` (status + OpenAI error body), so a front end maps it to one HTTP response;
problems after it (a time limit, the engine stopping) arrive as an SSE error event.
"""

from __future__ import annotations

from typing import Any

from engine.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.api.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from engine.api.served_model import ServedModel
from engine.api.serving_base import RequestContext, SSEStream
from engine.api.serving_chat import ChatCompletionServing
from engine.api.serving_completion import CompletionServing
from engine.api.serving_tokenization import TokenizationServing

__all__ = ["OpenAIServing", "RequestContext", "SSEStream"]


class OpenAIServing:
    def __init__(self, engine: Any, **options: Any) -> None:
        """`options`: vLLM's server options, as `ServedModel` takes and documents them
        (served_model_name, enable_auto_tool_choice, tool_call_parser, reasoning_parser,
        chat_template, default_chat_template_kwargs, enable_prompt_tokens_details)."""
        self.served = ServedModel(engine, **options)
        self.chat = ChatCompletionServing(self.served)
        self.completion = CompletionServing(self.served)
        self.tokenization = TokenizationServing(self.served)

    @property
    def engine(self) -> Any:
        return self.served.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.served.engine = engine

    @property
    def chat_template(self) -> str | None:
        """The template's text in place of the tokenizer's (None: the tokenizer's)."""
        return self.served.chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self.served.chat_template = template

    def models(self) -> ModelList:
        served = self.served
        cards = [
            ModelCard(id=name, max_model_len=served.max_model_len, quantization=served.quantization)
            for name in served.model_names
        ]
        return ModelList(data=cards)

    async def create_completion(
        self, request: CompletionRequest, ctx: RequestContext | None = None
    ) -> CompletionResponse | SSEStream:
        return await self.completion.create_completion(request, ctx)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, ctx: RequestContext | None = None
    ) -> ChatCompletionResponse | SSEStream:
        return await self.chat.create_chat_completion(request, ctx)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        return await self.tokenization.tokenize(request)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        return self.tokenization.detokenize(request)
