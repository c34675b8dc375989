"""The SamplingParams fields a beam search does not read, and their defaults: named in a
warning offline (engine/beam_search.py), reset by the API before a search runs
(engine/api/beam_search.py)."""

from __future__ import annotations

from engine.sampling_params import SamplingParams

BEAM_SEARCH_IGNORED_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "stop",
    "stop_token_ids",
    "logprobs",
    "prompt_logprobs",
)
"""SamplingParams fields a beam search does not read (it ranks the model's own logprobs)."""

NEUTRAL_BEAM_SEARCH_FIELDS = {
    name: getattr(SamplingParams(), name) for name in BEAM_SEARCH_IGNORED_FIELDS
}
"""Each ignored field at its default: what a beam search's parameters carry."""


def beam_search_ignored_fields(params: SamplingParams) -> list[str]:
    """The fields of `params` away from their defaults that a beam search ignores."""
    ignored = [
        f for f, default in NEUTRAL_BEAM_SEARCH_FIELDS.items() if getattr(params, f) != default
    ]
    if params.is_greedy:  # what a beam search ranks by: nothing ignored
        ignored.remove("temperature")
    return ignored
