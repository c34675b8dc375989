"""What a server serves, as every endpoint sees it: the engine, the names it answers to, its
tokenizer and chat template, the server's parser options, and how a request's prompt becomes
token ids the engine can take (on tokenizer threads while other requests stream).

The endpoints (serving_chat, serving_completion, serving_tokenization) share one
`ServedModel`, so an option changed on it reaches all of them.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.api.errors import APIError, model_not_found
from engine.api.inputs import chat_messages, check_prompt
from engine.api.logprobs import TokenIdText, TokenText
from engine.api.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from engine.api.reasoning import end_token_ids
from engine.api.reasoning_parsers import REASONING_PARSERS
from engine.api.tool_parsers import TOOL_CALL_PARSERS
from engine.api.tools import check_tools, template_tools
from engine.generation_config import GenerationDefaults
from engine.sampling_params import truncate_prompt
from engine.tokenizer import (
    ChatInputError,
    apply_chat_template,
    check_template_kwargs,
    load_chat_template,
)

# Prompt text of at least this many characters is tokenized on a worker thread while other
# requests are in flight, so that the event loop goes on streaming them meanwhile (the Rust
# tokenizer releases the GIL, and several prompts of one burst tokenize side by side). A
# hand-off to a thread and back costs more than a short prompt's tokenization, and with
# nothing else in flight the thread would only delay the first token (bench/RESULTS.md).
TOKENIZE_ON_THREAD_CHARS = 2048
TOKENIZE_THREADS = 4


class ServedModel:
    def __init__(
        self,
        engine: Any,
        served_model_name: str | None = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        chat_template: str | None = None,
        default_chat_template_kwargs: dict[str, Any] | None = None,
        enable_prompt_tokens_details: bool = False,
    ) -> None:
        """vLLM's server options. `enable_auto_tool_choice`: read tool calls out of a
        chat's output (tool_choice "auto") in the format of `tool_call_parser` (one of
        TOOL_CALL_PARSERS). `reasoning_parser` (one of REASONING_PARSERS): split a chat's
        output into the model's thought and its content. `chat_template`: a template (its
        text, or the path of a Jinja file) in place of the tokenizer's;
        `default_chat_template_kwargs`: template variables a request's
        chat_template_kwargs add to or override. `enable_prompt_tokens_details`: usage
        carries OpenAI's prompt_tokens_details (the prompts' prefix-cache hits)."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, got "
                f"{tool_call_parser!r}"
            )
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got "
                f"{reasoning_parser!r}"
            )
        self.reasoning_parser = REASONING_PARSERS.get(reasoning_parser)
        self.chat_template = None if chat_template is None else load_chat_template(chat_template)
        try:
            self.default_template_kwargs = check_template_kwargs(
                default_chat_template_kwargs, "default_chat_template_kwargs"
            )
        except ChatInputError as e:
            raise ValueError(str(e)) from None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.prompt_tokens_details = enable_prompt_tokens_details
        self.tool_parser = TOOL_CALL_PARSERS.get(tool_call_parser)
        self.engine = engine
        self.model_names: list[str] = (
            [served_model_name] if served_model_name else list(engine.served_model_names)
        )
        """Every name a request may give; responses carry the first."""
        self.model_name = self.model_names[0]
        self.max_model_len: int = engine.max_model_len
        self.quantization: str = engine.quantization
        self.generation_defaults: GenerationDefaults = engine.generation_defaults
        self.tokenizer = engine.tokenizer
        self.reasoning_end_ids = (
            end_token_ids(self.tokenizer)
            if self.reasoning_parser is not None and self.tokenizer is not None
            else ()
        )
        self._token_text = TokenText(self.tokenizer)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, "kvray-tokenize")
        self._tokenizing = 0
        """Prompts on the tokenizer threads now."""

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise model_not_found(model, self.model_names)

    def token_text(self, request: CompletionRequest | ChatCompletionRequest) -> TokenText:
        """How the request's logprobs name tokens: by text, or by id when it asks so."""
        return TokenIdText() if request.return_tokens_as_token_ids else self._token_text

    def default_max_tokens(self, prompt_len: int, api_default: int | None = None) -> int | None:
        """A request's length when it gives none: the API's default and the model's
        (generation config max_new_tokens), within what max_model_len leaves; None: up to
        max_model_len."""
        limits = [api_default, self.generation_defaults.max_tokens]
        if all(n is None for n in limits):
            return None
        return min(self.max_model_len - prompt_len, *(n for n in limits if n is not None))

    def checked_prompt(
        self, ids: list[int], request: CompletionRequest | ChatCompletionRequest, param: str
    ) -> list[int]:
        """The prompt as the engine gets it (truncate_prompt_tokens applied), if it fits."""
        if request.truncate_prompt_tokens == 0:
            raise APIError(
                "truncate_prompt_tokens must be >= 1 or -1, got 0", param="truncate_prompt_tokens"
            )
        try:
            ids = truncate_prompt(ids, request.truncate_prompt_tokens, self.max_model_len)
        except ValueError as e:
            raise APIError(str(e), param="truncate_prompt_tokens") from None
        return check_prompt(ids, self.max_model_len, param)

    async def apply_chat_template(
        self, request: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool
    ) -> list[int]:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template", param="messages")
        if request.continue_final_message and request.add_generation_prompt:
            raise APIError(
                "continue_final_message continues the last message: set add_generation_prompt "
                "to false with it",
                param="continue_final_message",
            )
        check_tools(request.tools)
        messages = chat_messages(request)
        size = sum(len(m["content"]) for m in messages)
        try:
            # apply_chat_template checks the request's names (check_template_kwargs).
            template_kwargs = {
                **self.default_template_kwargs,
                **(request.chat_template_kwargs or {}),
            }
            return await self.run_tokenizer(
                size,
                apply_chat_template,
                self.tokenizer,
                messages,
                request.add_generation_prompt,
                request.continue_final_message,
                template_tools(request.tools),
                template_kwargs,
                self.chat_template,
                add_special_tokens,
            )
        except ChatInputError as e:
            raise APIError(str(e), param=e.field) from None
        except Exception as e:
            raise APIError(f"messages: {e}", param="messages") from None

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text` as the engine's tokenizer encodes it."""
        return await self.run_tokenizer(len(text), self.engine.encode, text, add_special_tokens)

    async def run_tokenizer(self, num_chars: int, fn: Any, *args: Any) -> Any:
        """fn(*args) here for short text or with no other request in flight, else on the
        tokenizer threads."""
        alone = self.engine.num_requests == 0 and self._tokenizing == 0
        if num_chars < TOKENIZE_ON_THREAD_CHARS or alone:
            return fn(*args)
        self._tokenizing += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._tokenize_pool, fn, *args)
        finally:
            self._tokenizing -= 1
