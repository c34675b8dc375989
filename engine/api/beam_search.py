"""The completions API's beam search: vLLM's `use_beam_search` extra, `n` beams wide (or
`best_of`, returning the `n` best), with `length_penalty` and `early_stopping`.

A beam search ranks the model's own logprobs: a field only sampling reads, set to anything
but its neutral value, is a 400 naming it (as vLLM's SamplingParams with
use_beam_search refused temperature, top_p and top_k), and so is `stream` (the sequences are known only at the end). The
engine's side is engine/beam_search.py (not imported here: it loads torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from engine.api.errors import APIError
from engine.api.protocol import CompletionRequest
from engine.beam_search_fields import NEUTRAL_BEAM_SEARCH_FIELDS
from engine.sampling_params import MAX_LOGPROBS, SamplingParams


def _given(value: Any) -> bool:
    return value is not None


def _nonzero(value: Any) -> bool:
    return value is not None and value != 0


SAMPLING_ONLY: dict[str, Callable[[Any], bool]] = {
    "temperature": lambda v: v is not None and v > 0,
    "top_p": lambda v: v is not None and v != 1,
    "top_k": lambda v: v is not None and v not in (0, -1),
    "min_p": _nonzero,
    "seed": _given,
    "presence_penalty": _nonzero,
    "frequency_penalty": _nonzero,
    "repetition_penalty": lambda v: v is not None and v != 1,
    "min_tokens": _nonzero,
    "logit_bias": bool,
    "allowed_token_ids": _given,
    "stop": bool,
    "stop_token_ids": bool,
    "logprobs": _given,
    "prompt_logprobs": _given,
    "echo": bool,
    "response_format": lambda v: v is not None and v.type != "text",
    "structured_outputs": _given,
    "stream": bool,
}
"""Request fields a beam search cannot honour, and when a value asks for them."""


def beam_width(request: CompletionRequest) -> int:
    """The beams of a use_beam_search request (best_of, else n); APIError where it cannot."""
    for name, asks in SAMPLING_ONLY.items():
        if asks(getattr(request, name)):
            raise APIError(f"{name} cannot be used with use_beam_search", param=name)
    width = request.n if request.best_of is None else request.best_of
    field = "n" if request.best_of is None else "best_of"
    if width < request.n:
        raise APIError(f"best_of must be >= n ({request.n}) with use_beam_search", param=field)
    if width > MAX_LOGPROBS // 2:
        raise APIError(
            f"{field} (the beam width) must be <= {MAX_LOGPROBS // 2} with use_beam_search, "
            f"got {width}",
            param=field,
        )
    return width


def as_beam_search(params: SamplingParams, request: CompletionRequest) -> SamplingParams:
    """`params` (the request's, as a sampled request takes them) for a beam search: the
    fields it ignores back to their defaults (a model's sampling defaults do not apply)."""
    try:
        return dataclasses.replace(
            params,
            **NEUTRAL_BEAM_SEARCH_FIELDS,
            n=beam_width(request),
            use_beam_search=True,
            length_penalty=request.length_penalty,
            early_stopping=request.early_stopping,
        )
    except ValueError as e:
        raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None
