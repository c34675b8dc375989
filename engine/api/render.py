"""Engine outputs -> OpenAI response bodies and SSE chunks.

Engine outputs are cumulative; `DeltaTracker` remembers how much of each choice has been
sent, so a stream emits only the new text (and the logprobs of the new tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    TopLogprob,
    UsageInfo,
)
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs

DONE = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(body: dict) -> str:
    return sse(json.dumps(body))


class TokenText:
    """Token id -> its text, cached (logprobs ask for the same ids again and again)."""

    def __init__(self, tokenizer: object | None) -> None:
        # Without a tokenizer (dummy weights, token-id prompts) tokens have no text.
        self._decode: Callable[[list[int]], str] = (
            tokenizer.decode if tokenizer is not None else lambda ids: ""
        )
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text


def completion_logprobs(
    entries: list[TokenLogprobs], token_text: TokenText, text_offset: int = 0
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for entry in entries:
        token = token_text(entry.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append({token_text(i): lp for i, lp in entry.top.items()})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(entries: list[TokenLogprobs], token_text: TokenText) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = token_text(entry.token_id)
        top = [
            TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
            for t, lp in ((token_text(i), lp) for i, lp in entry.top.items())
        ]
        content.append(
            ChatTokenLogprob(
                token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def usage_of(prompt_lens: list[int], outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def completion_response(
    response_id: str,
    model: str,
    outputs: list[RequestOutput],
    usage: UsageInfo,
    token_text: TokenText,
    with_logprobs: bool,
) -> CompletionResponse:
    """One choice per (prompt, sample): index = prompt index * n + sample index."""
    choices = []
    for i, out in enumerate(outputs):
        for c in out.outputs:
            logprobs = None
            if with_logprobs and c.logprobs is not None:
                logprobs = completion_logprobs(c.logprobs, token_text)
            choices.append(
                CompletionChoice(
                    index=i * len(out.outputs) + c.index,
                    text=c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
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
) -> ChatCompletionResponse:
    choices = []
    for c in output.outputs:
        logprobs = None
        if with_logprobs and c.logprobs is not None:
            logprobs = chat_logprobs(c.logprobs, token_text)
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
            )
        )
    return ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=usage)


class _Sent:
    __slots__ = ("text", "logprobs", "offset", "finished", "started")

    def __init__(self) -> None:
        self.text = 0
        self.logprobs = 0
        self.offset = 0
        self.finished = False
        self.started = False


class DeltaTracker:
    """Turns successive cumulative outputs into OpenAI stream chunks (as SSE text)."""

    def __init__(
        self,
        *,
        chat: bool,
        response_id: str,
        created: int,
        model: str,
        include_usage: bool,
        with_logprobs: bool,
        token_text: TokenText,
    ) -> None:
        self.chat = chat
        self.response_id = response_id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.with_logprobs = with_logprobs
        self.token_text = token_text
        self._sent: dict[int, _Sent] = {}

    def chunks(self, output: RequestOutput, index_base: int = 0) -> str:
        """SSE events for what `output` adds to what was already sent ("" for nothing)."""
        events = []
        for completion in output.outputs:
            index = index_base + completion.index
            sent = self._sent.get(index)
            if sent is None:
                sent = self._sent[index] = _Sent()
            events.extend(self._choice_events(index, completion, sent))
        return "".join(events)

    def usage_chunk(self, usage: UsageInfo) -> str:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        chunk = cls(
            id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage
        )
        return sse(chunk.model_dump_json())

    def _choice_events(self, index: int, completion: CompletionOutput, sent: _Sent) -> list[str]:
        if sent.finished:
            return []
        events = []
        if self.chat and not sent.started:
            sent.started = True
            events.append(self._chat_event(index, {"role": "assistant", "content": ""}))
        text = completion.text[sent.text :]
        finish = completion.finish_reason
        if not text and finish is None:
            return events
        logprobs = None
        if self.with_logprobs and completion.logprobs is not None:
            new = completion.logprobs[sent.logprobs :]
            sent.logprobs += len(new)
            if self.chat:
                logprobs = chat_logprobs(new, self.token_text)
            else:
                logprobs = completion_logprobs(new, self.token_text, sent.offset)
                sent.offset += sum(len(token) for token in logprobs.tokens)
        sent.text += len(text)
        if self.chat:
            if text or logprobs is not None:
                events.append(self._chat_event(index, {"content": text}, logprobs=logprobs))
            if finish is not None:
                events.append(self._chat_event(index, {}, finish_reason=finish))
        else:
            choice = CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=finish
            )
            events.append(self._event(CompletionChunk, choice))
        sent.finished = finish is not None
        return events

    def _chat_event(
        self,
        index: int,
        delta: dict,
        logprobs: ChatLogprobs | None = None,
        finish_reason: str | None = None,
    ) -> str:
        choice = ChatChunkChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
        )
        return self._event(ChatCompletionChunk, choice)

    def _event(self, cls: type, choice: object) -> str:
        chunk = cls(id=self.response_id, created=self.created, model=self.model, choices=[choice])
        # OpenAI sends "usage": null on every chunk only when the client asked for usage.
        exclude = None if self.include_usage else {"usage"}
        return sse(chunk.model_dump_json(exclude=exclude))
