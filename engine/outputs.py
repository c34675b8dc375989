"""What the engine hands back to callers, per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and of the top-N candidates at one position."""

    token_id: int
    logprob: float
    rank: int
    """1 = the most likely token."""
    top: dict[int, float] = field(default_factory=dict)
    """Top-N token id -> logprob, most likely first."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """None while running; "stop" (EOS, stop token or stop string), "length" or "abort"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sequence, if any."""
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    """A beam search's: the sum of the sequence's token logprobs (sampled outputs: None)."""


@dataclass
class RequestOutput:
    """Cumulative state of one request (all n samples); `finished` once every sample ends."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (no
    token precedes it); each the prompt token's logprob given the tokens before it, and the
    top-N there. Complete from the first output after the prompt was computed (the output
    that carries the first generated token); None before and without the option."""


class RequestFailedError(RuntimeError):
    """A step failed on this request alone (its grammar or its detokenizer raised): the
    engine aborted it, freed its KV cache and goes on with the others."""
