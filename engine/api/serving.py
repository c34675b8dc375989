"""OpenAI endpoints over an `AsyncEngine`, independent of the web framework.

`create_completion` / `create_chat_completion` return a response model, or for
`stream=True` an `SSEStream` of ready-to-send SSE text, as soon as the engine has taken the
request (its response can start while the prompt is computed). Anything wrong before that
raises `APIError` (status + OpenAI error body), so a front end maps it to one HTTP response;
problems after it (a time limit, the engine stopping) arrive as an SSE error event.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from engine.api.errors import APIError, model_not_found
from engine.api.inputs import (
    chat_messages,
    check_prompt,
    echo_only,
    prefix_cache_salt,
    prompt_param,
    structured_output_param,
    to_sampling_params,
)
from engine.api.logprobs import TokenIdText, TokenText
from engine.api.output_streams import TimeLimit, merge_streams, next_output
from engine.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.api.reasoning import ReasoningUse, end_token_ids, reasoning_use
from engine.api.reasoning_parsers import REASONING_PARSERS
from engine.api.render import CompletionFormat, chat_response, completion_response, usage_of
from engine.api.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    UsageInfo,
)
from engine.api.stream import DONE, ChatDeltaTracker, CompletionDeltaTracker, sse_error
from engine.api.tool_parsers import TOOL_CALL_PARSERS
from engine.api.tools import ToolUse, check_tools, template_tools, tool_use
from engine.generation_config import GenerationDefaults
from engine.outputs import RequestOutput
from engine.sampling_params import RequestInputError, SamplingParams, truncate_prompt
from engine.tokenizer import (
    ChatInputError,
    apply_chat_template,
    check_template_kwargs,
    load_chat_template,
)

# Prompt text of at least this many characters is tokenized on a worker thread while other
# requests are in flight, so that the event loop goes on streaming them meanwhile (the Rust
# tokenizer releases the GIL, and several prompts of one burst tokenize side by side). On an
# H200 host 1,024 words (about 6,000 characters) took 2-3 ms on a replica's loop with the
# offsets-tracking encode; the fast encode (engine.tokenizer.encode_text) takes about a third
# of that. Handing work to a thread and back costs about a tenth of a millisecond (0.14 ms
# on a 2-core machine), more than a short prompt's tokenization, and with nothing else in
# flight that is all the thread would change: the first token would come that much later.
TOKENIZE_ON_THREAD_CHARS = 2048
TOKENIZE_THREADS = 4


@dataclass
class RequestContext:
    """What the front end decided about a request before it reached the engine."""

    request_id: str | None = None
    """The client's id of the request (its X-Request-Id): response ids are made of it."""
    priority: int = 0
    """The tenant's priority: a request may ask for a larger (later) value, never smaller."""
    cache_salt: str | None = None
    """Prefix-cache salt: requests only share cached blocks with the same salt."""
    deadline: float | None = None
    """Wall-clock time (time.time()) after which the request is aborted with a 408."""


@dataclass
class SSEStream:
    events: AsyncIterator[str] = field(init=False)
    prompt_tokens: int = 0
    usage: UsageInfo = field(default_factory=UsageInfo)
    """Filled in when the stream ends (for per-tenant token accounting)."""


class OpenAIServing:
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
        self.generation_defaults: GenerationDefaults = engine.generation_defaults
        self.tokenizer = engine.tokenizer
        self._reasoning_end_ids = (
            end_token_ids(self.tokenizer)
            if self.reasoning_parser is not None and self.tokenizer is not None
            else ()
        )
        self.token_text = TokenText(self.tokenizer)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, "kvray-tokenize")
        self._tokenizing = 0
        """Prompts on the tokenizer threads now."""

    def models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=name, max_model_len=self.max_model_len) for name in self.model_names]
        )

    async def create_completion(
        self, request: CompletionRequest, ctx: RequestContext | None = None
    ) -> CompletionResponse | SSEStream:
        self._check_model(request.model)
        if request.best_of not in (None, request.n):
            raise APIError(f"best_of must equal n ({request.n})", param="best_of")
        encoded = await self._encode_prompts(request)
        prompts = [
            self._checked_prompt(ids, request, prompt_param(request, i))
            for i, ids in enumerate(encoded)
        ]
        # A truncated prompt echoes as the tokens the model saw.
        truncated = any(len(a) != len(b) for a, b in zip(encoded, prompts, strict=True))
        fmt = CompletionFormat(
            logprobs=request.logprobs,
            echo=self._echo_texts(request.prompt, prompts, truncated) if request.echo else None,
            echo_only=echo_only(request),
            prompt_logprobs=request.prompt_logprobs,
            return_token_ids=request.return_token_ids,
        )
        # OpenAI's default of 16 yields to a long prompt (and to the model's own default);
        # an explicit max_tokens does not.
        explicit = "max_tokens" in request.model_fields_set
        params = [
            to_sampling_params(
                request,
                len(ids),
                self.max_model_len,
                request.max_tokens if explicit else self._default_max_tokens(len(ids), 16),
                "max_tokens",
                request.logprobs,
                defaults=self.generation_defaults.sampling,
            )
            for ids in prompts
        ]
        return await self._run(request, prompts, params, ctx or RequestContext(), fmt)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, ctx: RequestContext | None = None
    ) -> ChatCompletionResponse | SSEStream:
        self._check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if request.prompt_logprobs is not None and request.stream:
            raise APIError(
                "prompt_logprobs come with a whole response: not with stream=true",
                param="prompt_logprobs",
            )
        ids = await self._apply_chat_template(request, request.add_special_tokens)
        ids = self._checked_prompt(ids, request, "messages")
        tools = tool_use(request, self.tool_parser, self.enable_auto_tool_choice, self.tokenizer)
        reasoning = reasoning_use(
            self.reasoning_parser, self.tokenizer, ids, self._reasoning_end_ids
        )
        if request.max_completion_tokens is not None:
            max_field, max_tokens = "max_completion_tokens", request.max_completion_tokens
        else:
            max_field, max_tokens = "max_tokens", request.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens(len(ids))
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = to_sampling_params(
            request,
            len(ids),
            self.max_model_len,
            max_tokens,
            max_field,
            logprobs,
            tools,
            reasoning,
            defaults=self.generation_defaults.sampling,
        )
        return await self._run(
            request, [ids], [params], ctx or RequestContext(), None, tools, reasoning
        )

    def _default_max_tokens(self, prompt_len: int, api_default: int | None = None) -> int | None:
        """A request's length when it gives none: the API's default and the model's
        (generation config max_new_tokens), within what max_model_len leaves; None: up to
        max_model_len."""
        limits = [api_default, self.generation_defaults.max_tokens]
        if all(n is None for n in limits):
            return None
        return min(self.max_model_len - prompt_len, *(n for n in limits if n is not None))

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """The ids a completion of `prompt` (or a chat of `messages`) would compute."""
        self._check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(
                "give either prompt (tokenized as a completion's) or messages (as a chat's)",
                param="prompt",
            )
        special = request.add_special_tokens
        if request.messages is not None:
            ids = await self._apply_chat_template(request, bool(special))
        elif self.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt")
        else:
            ids = await self._tokenize(
                len(request.prompt), self.engine.encode, request.prompt, special is not False
            )
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request.model)
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        size = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < size]
        if bad:
            raise APIError(
                f"tokens: token id {bad[0]} is out of the tokenizer's range [0, {size})",
                param="tokens",
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

    def _token_text(self, request: CompletionRequest | ChatCompletionRequest) -> TokenText:
        """How the request's logprobs name tokens: by text, or by id when it asks so."""
        return TokenIdText() if request.return_tokens_as_token_ids else self.token_text

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise model_not_found(model, self.model_names)

    async def _encode_prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if self.tokenizer is None and (isinstance(prompt, str) or isinstance(prompt[0], str)):
            raise APIError(
                "this model has no tokenizer: send the prompt as token ids", param="prompt"
            )
        special = request.add_special_tokens
        if isinstance(prompt, str):
            return [await self._tokenize(len(prompt), self.engine.encode, prompt, special)]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], str):
            encoded = [self._tokenize(len(p), self.engine.encode, p, special) for p in prompt]
            return list(await asyncio.gather(*encoded))
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [list(p) for p in prompt]

    def _checked_prompt(
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

    def _echo_texts(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        ids: list[list[int]],
        decode: bool = False,
    ) -> list[str]:
        """Each prompt's text as echo returns it: as given, token ids decoded (all decoded
        with `decode`)."""
        if isinstance(prompt, str) and not decode:
            return [prompt]
        if isinstance(prompt[0], str) and not decode:
            return list(prompt)
        if self.tokenizer is None:
            raise APIError(
                "echo needs a tokenizer to turn a token-id prompt into text, and this model "
                "has none",
                param="echo",
            )
        return [self.tokenizer.decode(p) for p in ids]

    async def _apply_chat_template(
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
            return await self._tokenize(
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

    async def _tokenize(self, num_chars: int, fn: Any, *args: Any) -> Any:
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

    async def _run(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        params: list[SamplingParams],
        ctx: RequestContext,
        fmt: CompletionFormat | None,
        tools: ToolUse | None = None,
        reasoning: ReasoningUse | None = None,
    ) -> CompletionResponse | ChatCompletionResponse | SSEStream:
        """`fmt`: a completion's; None for a chat. `tools`: what a chat's tools ask of it;
        `reasoning`: how its output splits into thought and content."""
        chat = fmt is None
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{ctx.request_id or uuid.uuid4().hex}"
        # A client's id may come again while its first request runs (a retry): the engine's
        # ids stay unique.
        engine_id = response_id if ctx.request_id is None else f"{response_id}-{uuid.uuid4().hex}"
        priority = ctx.priority if request.priority is None else max(ctx.priority, request.priority)
        salt = prefix_cache_salt(ctx.cache_salt, request.cache_salt)
        gens = [
            self._generate(ids, sp, f"{engine_id}-{i}", priority, salt, prompt_param(request, i))
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        limit = TimeLimit(ctx.deadline)
        outputs = merge_streams(gens)
        # A grammar that does not compile fails the first output: name the field it came in.
        structured = structured_output_param(request, tools)
        try:
            first = await next_output(outputs, limit, structured)
        except BaseException:
            limit.cancel()
            await outputs.aclose()
            raise
        prompt_lens = [len(ids) for ids in prompts]
        if request.stream:
            return self._stream(
                request, outputs, first, limit, response_id, prompt_lens, fmt, tools, reasoning
            )
        async with aclosing(outputs):
            finals: dict[int, RequestOutput] = {}
            item = first
            try:
                while item is not None:
                    finals[item[0]] = item[1]
                    item = await next_output(outputs, limit)
            finally:
                limit.cancel()
        final = [finals[i] for i in range(len(prompts))]
        if chat:
            usage = usage_of(prompt_lens, final, cached_details=self.prompt_tokens_details)
            return chat_response(
                response_id,
                self.model_name,
                final[0],
                usage,
                self._token_text(request),
                request.logprobs,
                request.prompt_logprobs,
                tools,
                reasoning,
                request.return_token_ids,
            )
        usage = usage_of(prompt_lens, final, fmt.echo_only, self.prompt_tokens_details)
        token_text = self._token_text(request)
        return completion_response(response_id, self.model_name, final, usage, token_text, fmt)

    async def _generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        cache_salt: str | None,
        prompt_field: str,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt; input the engine refuses (a token id past
        the vocabulary) is an APIError naming the request's field, the prompt's as
        `prompt_field`."""
        outputs = self.engine.generate(prompt, params, request_id, priority, cache_salt)
        async with aclosing(outputs):
            try:
                async for output in outputs:
                    yield output
            except RequestInputError as e:
                field = prompt_field if e.field == "prompt" else e.field
                raise APIError(f"{field} {e.problem}", param=field) from None

    def _stream(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        first: tuple[int, RequestOutput],
        limit: TimeLimit,
        response_id: str,
        prompt_lens: list[int],
        fmt: CompletionFormat | None,
        tools: ToolUse | None,
        reasoning: ReasoningUse | None,
    ) -> SSEStream:
        options = request.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        echo_only = fmt is not None and fmt.echo_only
        details = self.prompt_tokens_details
        common = dict(
            response_id=response_id,
            created=int(time.time()),
            model=self.model_name,
            n=request.n,
            include_usage=include_usage,
            token_text=self._token_text(request),
        )
        if fmt is None:
            tracker = ChatDeltaTracker(
                with_logprobs=request.logprobs,
                tools=tools,
                reasoning=reasoning,
                return_token_ids=request.return_token_ids,
                **common,
            )
        else:
            tracker = CompletionDeltaTracker(fmt=fmt, **common)
        result = SSEStream(prompt_tokens=sum(prompt_lens))

        async def events() -> AsyncIterator[str]:
            latest: dict[int, RequestOutput] = {}
            async with aclosing(outputs):
                item = first
                try:
                    while item is not None:
                        i, output = item
                        latest[i] = output
                        if continuous:
                            tracker.usage = usage_of(
                                prompt_lens, list(latest.values()), echo_only, details
                            )
                        text = tracker.chunks(output, prompt_index=i)
                        if text:
                            yield text
                        item = await next_output(outputs, limit)
                except APIError as e:
                    yield sse_error(e.to_response().model_dump())
                    yield DONE
                    return
                finally:
                    limit.cancel()
            result.usage = usage_of(prompt_lens, list(latest.values()), echo_only, details)
            if include_usage:
                yield tracker.usage_chunk(result.usage)
            yield DONE

        result.events = events()
        return result
