"""POST /v1/chat/completions: messages through the chat template, the server's tool and
reasoning parsers over the output, and the response whole or as a stream of chunks."""

from __future__ import annotations

from engine.api.errors import APIError
from engine.api.inputs import to_sampling_params
from engine.api.protocol import ChatCompletionRequest
from engine.api.reasoning import ReasoningUse, reasoning_use
from engine.api.render import chat_response
from engine.api.responses import ChatCompletionResponse
from engine.api.serving_base import GeneratingEndpoint, RequestContext, SSEStream
from engine.api.stream import ChatDeltaTracker
from engine.api.tools import ToolUse, tool_use
from engine.sampling_params import SamplingParams


class ChatCompletionServing(GeneratingEndpoint):
    response_id_prefix = "chatcmpl"

    async def create_chat_completion(
        self, request: ChatCompletionRequest, ctx: RequestContext | None = None
    ) -> ChatCompletionResponse | SSEStream:
        served = self.served
        served.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if request.prompt_logprobs is not None and request.stream:
            raise APIError(
                "prompt_logprobs come with a whole response: not with stream=true",
                param="prompt_logprobs",
            )
        ids = await served.apply_chat_template(request, request.add_special_tokens)
        ids = served.checked_prompt(ids, request, "messages")
        tools = tool_use(
            request, served.tool_parser, served.enable_auto_tool_choice, served.tokenizer
        )
        reasoning = reasoning_use(
            served.reasoning_parser, served.tokenizer, ids, served.reasoning_end_ids
        )
        params = self._sampling_params(request, len(ids), tools, reasoning)
        generation = await self._start(request, [ids], [params], ctx or RequestContext(), tools)
        if request.stream:
            tracker = ChatDeltaTracker(
                with_logprobs=request.logprobs,
                tools=tools,
                reasoning=reasoning,
                return_token_ids=request.return_token_ids,
                **self._tracker_fields(request, generation),
            )
            return self._stream(request, generation, tracker)
        final = await self._final_outputs(generation)
        return chat_response(
            generation.response_id,
            served.model_name,
            final[0],
            self._usage(generation, final),
            served.token_text(request),
            request.logprobs,
            request.prompt_logprobs,
            tools,
            reasoning,
            request.return_token_ids,
        )

    def _sampling_params(
        self,
        request: ChatCompletionRequest,
        prompt_len: int,
        tools: ToolUse | None,
        reasoning: ReasoningUse | None,
    ) -> SamplingParams:
        if request.max_completion_tokens is not None:
            max_field, max_tokens = "max_completion_tokens", request.max_completion_tokens
        else:
            max_field, max_tokens = "max_tokens", request.max_tokens
        if max_tokens is None:
            max_tokens = self.served.default_max_tokens(prompt_len)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return to_sampling_params(
            request,
            prompt_len,
            self.served.max_model_len,
            max_tokens,
            max_field,
            logprobs,
            tools,
            reasoning,
            defaults=self.served.generation_defaults.sampling,
        )
