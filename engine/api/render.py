"""Engine outputs -> OpenAI response bodies (engine/api/stream.py streams them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.api.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from engine.api.reasoning import ReasoningUse
from engine.api.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprob,
    PromptTokensDetails,
    UsageInfo,
)
from engine.api.tool_output import tool_message
from engine.api.tools import ToolUse
from engine.outputs import CompletionOutput, RequestOutput


def usage_of(
    prompt_lens: list[int],
    outputs: list[RequestOutput],
    echo_only: bool = False,
    cached_details: bool = False,
) -> UsageInfo:
    """`cached_details`: with OpenAI's prompt_tokens_details (the prompts' prefix-cache
    hits)."""
    prompt = sum(prompt_lens)
    completion = 0 if echo_only else sum(len(c.token_ids) for out in outputs for c in out.outputs)
    details = None
    if cached_details:
        details = PromptTokensDetails(cached_tokens=sum(out.num_cached_tokens for out in outputs))
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


@dataclass(frozen=True)
class CompletionFormat:
    """What a completion's choices show besides the generated text."""

    logprobs: int | None = None
    """OpenAI's logprobs: top-N per token; None: no logprobs."""
    echo: list[str] | None = None
    """OpenAI's echo: per prompt, the text its choices start with."""
    echo_only: bool = False
    """echo with max_tokens=0: the prompt alone (the engine still generates one token)."""
    prompt_logprobs: int | None = None
    """vLLM's prompt_logprobs: top-N per prompt token."""
    return_token_ids: bool = False
    """vLLM's: each choice shows its prompt's and its generated token ids."""

    @property
    def shows_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None or (
            self.echo is not None and self.logprobs is not None
        )


@dataclass(frozen=True)
class PromptPart:
    """A choice's prompt: the echoed text and its logprobs, vLLM's prompt_logprobs."""

    text: str = ""
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


def prompt_part(
    fmt: CompletionFormat, prompt_index: int, output: RequestOutput, token_text: TokenText
) -> PromptPart:
    ids, entries = output.prompt_token_ids, output.prompt_logprobs
    text, logprobs, prompt_logprobs = "", None, None
    if fmt.echo is not None:
        text = fmt.echo[prompt_index]
        if fmt.logprobs is not None:
            logprobs = echo_logprobs(ids, entries, token_text, fmt.logprobs)
    if fmt.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(ids, entries, token_text, fmt.prompt_logprobs)
    return PromptPart(text, logprobs, prompt_logprobs)


def shown(fmt: CompletionFormat, completion: CompletionOutput) -> CompletionOutput:
    """What a choice shows of its generated tokens: none with echo_only."""
    if not fmt.echo_only:
        return completion
    # OpenAI's finish reason for max_tokens=0 whatever the one token was; an abort stays one.
    finish = completion.finish_reason
    return replace(
        completion,
        text="",
        token_ids=[],
        logprobs=None,
        finish_reason=finish if finish in (None, "abort") else "length",
    )


def token_ids_of(asked: bool, output: RequestOutput, completion: CompletionOutput) -> dict:
    """A choice's vLLM return_token_ids fields: its prompt's ids and its generated ids."""
    if not asked:
        return {}
    return {"prompt_token_ids": output.prompt_token_ids, "token_ids": list(completion.token_ids)}


def completion_response(
    response_id: str,
    model: str,
    outputs: list[RequestOutput],
    usage: UsageInfo,
    token_text: TokenText,
    fmt: CompletionFormat,
) -> CompletionResponse:
    """One choice per (prompt, sample): index = prompt index * n + sample index."""
    choices = []
    for i, out in enumerate(outputs):
        prompt = prompt_part(fmt, i, out, token_text)
        for c in out.outputs:
            c = shown(fmt, c)
            logprobs = prompt.logprobs
            if fmt.logprobs is not None and c.logprobs is not None:
                generated = completion_logprobs(c.logprobs, token_text, len(prompt.text))
                logprobs = generated if logprobs is None else joined(logprobs, generated)
            choices.append(
                CompletionChoice(
                    index=i * len(out.outputs) + c.index,
                    text=prompt.text + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    prompt_logprobs=prompt.prompt_logprobs,
                    **token_ids_of(fmt.return_token_ids, out, c),
                )
            )
    return CompletionResponse(id=response_id, model=model, choices=choices, usage=usage)


def chat_response(
    response_id: str,
    model: str,
    output: RequestOutput,
    usage: UsageInfo,
    token_text: TokenText,
    with_logprobs: bool,
    prompt_logprobs: int | None = None,
    tools: ToolUse | None = None,
    reasoning: ReasoningUse | None = None,
    return_token_ids: bool = False,
) -> ChatCompletionResponse:
    """`prompt_logprobs`: vLLM's top-N per prompt token, on the response; `tools`: read each
    choice's text for tool calls; `reasoning`: split each choice's text into the model's
    thought and its content first (the tool calls are read in the content alone);
    `return_token_ids`: the prompt's ids on the response, each choice's on the choice."""
    choices = []
    for c in output.outputs:
        logprobs = None
        if with_logprobs and c.logprobs is not None:
            logprobs = chat_logprobs(c.logprobs, token_text)
        thought, content = (None, c.text) if reasoning is None else reasoning.split(c.text)
        if tools is None:
            message, finish = ChatResponseMessage(content=content), c.finish_reason
        else:
            message, finish = tool_message(tools, content or "", c.finish_reason)
        if thought is not None:
            message = message.model_copy(
                update={"reasoning": thought, "reasoning_content": thought}
            )
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish,
                token_ids=list(c.token_ids) if return_token_ids else None,
            )
        )
    shown = None
    if prompt_logprobs is not None:
        ids, entries = output.prompt_token_ids, output.prompt_logprobs
        shown = vllm_prompt_logprobs(ids, entries, token_text, prompt_logprobs)
    return ChatCompletionResponse(
        id=response_id,
        model=model,
        choices=choices,
        usage=usage,
        prompt_logprobs=shown,
        prompt_token_ids=output.prompt_token_ids if return_token_ids else None,
    )
