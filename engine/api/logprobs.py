"""The engine's TokenLogprobs in the shapes clients read: OpenAI's completion and chat
logprobs, and vLLM's prompt_logprobs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice

from engine.api.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)
from engine.outputs import TokenLogprobs


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


class TokenIdText(TokenText):
    """vLLM's return_tokens_as_token_ids: token id -> "token_id:<id>", for tokens whose text
    is not valid UTF-8 on its own (a byte-level BPE piece of a character)."""

    def __init__(self) -> None:
        super().__init__(None)

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def completion_logprobs(
    entries: list[TokenLogprobs],
    token_text: TokenText,
    text_offset: int = 0,
) -> CompletionLogprobs:
    """Generated tokens' logprobs; `text_offset`: where the first token starts in the text."""
    return _completion_logprobs(((e.token_id, e) for e in entries), token_text, text_offset)


def echo_logprobs(
    prompt_ids: list[int],
    entries: list[TokenLogprobs | None] | None,
    token_text: TokenText,
    top_n: int,
) -> CompletionLogprobs:
    """An echoed prompt's tokens: the first without a logprob (nothing precedes it).
    `entries` None (the engine gave none) leaves every logprob null."""
    entries = entries if entries is not None else [None] * len(prompt_ids)
    return _completion_logprobs(zip(prompt_ids, entries, strict=True), token_text, 0, top_n)


def _completion_logprobs(
    entries: Iterable[tuple[int, TokenLogprobs | None]],
    token_text: TokenText,
    text_offset: int,
    top_n: int | None = None,
) -> CompletionLogprobs:
    # The engine computes a prompt's top-N for the larger of two requested Ns; top_n cuts.
    out = CompletionLogprobs()
    for token_id, entry in entries:
        token = token_text(token_id)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(entry.logprob)
            top = islice(entry.top.items(), top_n)
            out.top_logprobs.append({token_text(i): lp for i, lp in top})
    return out


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def vllm_prompt_logprobs(
    prompt_ids: list[int],
    entries: list[TokenLogprobs | None] | None,
    token_text: TokenText,
    top_n: int,
) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's shape: per position, the prompt token itself (at its own rank) and the top-N
    (ranks 1..N); None where there is no logprob (the first position)."""
    entries = entries if entries is not None else [None] * len(prompt_ids)
    out: list[dict[int, PromptLogprob] | None] = []
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        ranked = {token_id: _candidate(entry.logprob, entry.rank, token_text(token_id))}
        for rank, (i, lp) in enumerate(islice(entry.top.items(), top_n), start=1):
            if i not in ranked:
                ranked[i] = _candidate(lp, rank, token_text(i))
        out.append(ranked)
    return out


def _candidate(logprob: float, rank: int, token: str) -> PromptLogprob:
    return PromptLogprob(logprob=logprob, rank=rank, decoded_token=token)


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
