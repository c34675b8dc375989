"""What a request is checked and completed with before the engine takes it.

`InputProcessor.process` turns a prompt (text or token ids) and its SamplingParams into what
the scheduler runs: the prompt's ids, truncated as asked and checked against the model; the
params with every id that ends a request as EOS does; the grammar of a structured output.
Input the engine cannot serve raises ValueError (RequestInputError names the field).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.sampling_params import RequestInputError, SamplingParams, truncate_prompt
from engine.structured_output import StructuredOutputs
from engine.tokenizer import encode_text, load_tokenizer
from engine.worker.loader import ModelSource
from engine.worker.sampler import held_back_below_min_tokens


@dataclass
class ProcessedInput:
    prompt: str | None
    """The prompt's text where it came as text."""
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    grammar: Any
    """The structured output's compiled grammar; None without one."""


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any | None,
        vocab_size: int,
        max_model_len: int,
        *,
        eos_token_id: int | None,
        runner_eos_token_id: int | None,
        more_eos_token_ids: list[int],
        check_prompt_len: Callable[[int], None],
        structured: StructuredOutputs,
    ) -> None:
        """`runner_eos_token_id`: the EOS the model runner holds back for min_tokens;
        `more_eos_token_ids`: the others that end a request as EOS does;
        `check_prompt_len`: the scheduler's refusal of a prompt it could never run."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.runner_eos_token_id = runner_eos_token_id
        self.more_eos_token_ids = more_eos_token_ids
        self.check_prompt_len = check_prompt_len
        self.structured = structured

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids, with the tokenizer's special tokens (a Llama 3's BOS) as
        vLLM tokenizes prompts; a tokenizer without a post-processor adds none."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass the prompt as token ids")
        return encode_text(self.tokenizer, prompt, add_special_tokens)

    def process(
        self, prompt: str | list[int], sampling_params: SamplingParams, grammar: Any = None
    ) -> ProcessedInput:
        """`grammar`: the one compiled for its structured_output already (else it is
        compiled here)."""
        if isinstance(prompt, str):
            prompt_text, prompt_ids = prompt, self.encode(prompt)
        else:
            prompt_text, prompt_ids = None, list(prompt)
        keep = sampling_params.truncate_prompt_tokens
        prompt_ids = truncate_prompt(prompt_ids, keep, self.max_model_len)
        self._check_prompt(prompt_ids)
        self._check_token_ids(sampling_params)
        self._check_stop(sampling_params)
        sampling_params = self._with_every_eos(sampling_params)
        sampling_params = self._with_grammar_end_allowed(sampling_params)
        self._check_min_tokens_leave_a_token(sampling_params)
        if sampling_params.structured_output is None:
            grammar = None
        else:
            if grammar is None:
                grammar = self.structured.grammar(sampling_params.structured_output)
            self._check_grammar_meets_allowed_ids(sampling_params, grammar)
        return ProcessedInput(prompt_text, prompt_ids, sampling_params, grammar)

    def _with_every_eos(self, params: SamplingParams) -> SamplingParams:
        more = [t for t in self.more_eos_token_ids if t not in params.stop_token_ids]
        if params.ignore_eos or not more:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *more])

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        # Before the grammar compiles and the samples are built.
        self.check_prompt_len(len(prompt_ids))
        bad = [t for t in prompt_ids if type(t) is not int or not 0 <= t < self.vocab_size]
        if not bad:
            return
        for t in bad:
            if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                raise RequestInputError(
                    "prompt", f"must be text or token ids (ints), got {type(t).__name__} {t!r}"
                )
            if not 0 <= t < self.vocab_size:
                raise RequestInputError(
                    "prompt", f"token id {t} is out of range [0, {self.vocab_size})"
                )
        prompt_ids[:] = [int(t) for t in prompt_ids]  # numpy's integers, say

    def _with_grammar_end_allowed(self, params: SamplingParams) -> SamplingParams:
        """A structured output ends with EOS once its value is complete (the grammar allows
        nothing else then): allowed_token_ids take it too, or the request could not end."""
        allowed, eos = params.allowed_token_ids, self.eos_token_id
        if params.structured_output is None or allowed is None or eos is None or eos in allowed:
            return params
        return dataclasses.replace(params, allowed_token_ids=[*allowed, eos])

    def _check_min_tokens_leave_a_token(self, params: SamplingParams) -> None:
        """Below min_tokens, the ids that end a request are held back: allowed_token_ids
        made of those alone would leave nothing to sample."""
        if not params.min_tokens or params.allowed_token_ids is None:
            return
        held_back = held_back_below_min_tokens(params, self.runner_eos_token_id)
        if set(held_back).issuperset(params.allowed_token_ids):
            raise RequestInputError(
                "allowed_token_ids",
                f"hold only ids that end the request, which min_tokens={params.min_tokens} "
                "holds back: nothing could be sampled",
            )

    def _check_grammar_meets_allowed_ids(self, params: SamplingParams, grammar: Any) -> None:
        starts_later = params.structured_output.starts_after_token_ids is not None
        allowed = params.allowed_bitmask(self.vocab_size)
        if allowed is None or starts_later:
            return  # a later start is checked at each step (LLMEngine.step)
        if not np.bitwise_and(self.structured.first_mask(grammar), allowed).any():
            raise RequestInputError(
                "allowed_token_ids",
                "allow none of the tokens the structured output may start with",
            )

    def _check_stop(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise RequestInputError(
                "stop", "needs the model's tokenizer, and this model has none: use stop_token_ids"
            )

    def _check_token_ids(self, params: SamplingParams) -> None:
        """The request's own ids are in the vocabulary (SamplingParams checks them >= 0);
        the EOS ids the engine adds to stop_token_ids are not the request's to answer for."""
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= self.vocab_size]
            if bad:
                raise RequestInputError(
                    name, f"token id {bad[0]} is out of range [0, {self.vocab_size})"
                )


def check_request_id(request_id: Any) -> None:
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")


def load_tokenizer_for(
    source: ModelSource, tokenizer: str | None, tokenizer_mode: str = "auto"
) -> Any | None:
    """The tokenizer named, else the model's own: a GGUF file's, or the files beside the
    model's weights. `tokenizer_mode`: engine.tokenizer.load_tokenizer's."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer, tokenizer_mode=tokenizer_mode)
    if source.kind == "gguf":
        path = Path(source.path)
        return load_tokenizer(path.parent, gguf_file=path.name, tokenizer_mode=tokenizer_mode)
    folder = Path(source.path)
    if folder.is_dir() and any((folder / f).exists() for f in _TOKENIZER_FILES):
        return load_tokenizer(folder, tokenizer_mode=tokenizer_mode)
    # No tokenizer (e.g. dummy shapes): prompts must be token ids, outputs have no text.
    return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
