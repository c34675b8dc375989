"""Per-request sampling settings, named and defaulted as vLLM's `SamplingParams`.

Validated once at construction, so everything downstream (scheduler, sampler, workers)
can trust the values. Bad input raises ValueError naming the field and its allowed range.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

import numpy as np

_GREEDY_EPS = 1e-5
"""Temperatures below this are treated as greedy (dividing by them overflows the logits)."""

MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0
    """An output after every step that added tokens, with everything so far."""
    FINAL_ONLY = 2
    """Only the finished output (what offline `LLM.generate` returns)."""


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class StructuredOutputError(ValueError):
    """A structured_output (OpenAI's response_format) this server cannot follow."""


class RequestInputError(ValueError):
    """Input the engine cannot serve, naming the field it came in (`prompt`, `logit_bias`):
    a front end can name its own field instead (`prompt[1]` of several prompts)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple:
        # Crosses from the engine process with its field intact.
        return (type(self), (self.field, self.problem))


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain a request's output: to a value that matches a JSON Schema (given as text), a
    regular expression, one of `choice`'s strings, or an EBNF grammar (xgrammar's dialect,
    rules `name ::= ...`, the start rule `root`); with none of them, to any JSON object
    (OpenAI's "json_object"). At most one."""

    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    starts_after_token_ids: tuple[int, ...] | None = None
    """The output is free until it has generated these tokens (a reasoning model's end of
    thought, `</think>`), and follows the grammar from the next token on. None: from the
    first token."""

    def __post_init__(self) -> None:
        after = self.starts_after_token_ids
        if after is not None:
            if not isinstance(after, list | tuple) or not all(isinstance(t, int) for t in after):
                raise StructuredOutputError(
                    "structured_output.starts_after_token_ids must be a list of token ids"
                )
            if not after:
                raise StructuredOutputError(
                    "structured_output.starts_after_token_ids must not be empty (None: the "
                    "grammar applies from the first token)"
                )
            object.__setattr__(self, "starts_after_token_ids", tuple(after))
        for name, what in (("json_schema", "JSON Schema text"), ("regex", "a string")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise StructuredOutputError(
                    f"structured_output.{name} must be {what}, got {type(value).__name__}"
                )
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise StructuredOutputError("structured_output.grammar must be EBNF text")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not all(isinstance(c, str) for c in choice) or not choice:
                raise StructuredOutputError(
                    "structured_output.choice must be a non-empty list of strings"
                )
            object.__setattr__(self, "choice", tuple(choice))
        given = [name for name in self._KINDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise StructuredOutputError(
                f"structured_output takes one of json_schema, regex, choice or grammar, "
                f"got {' and '.join(given)}"
            )

    _KINDS = ("json_schema", "regex", "choice", "grammar")

    @property
    def kind(self) -> str:
        """Which constraint: one of _KINDS, or "json_object"."""
        return next((k for k in self._KINDS if getattr(self, k) is not None), "json_object")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    """Number of output sequences to return for the prompt."""
    temperature: float = 1.0
    """0 (or below 1e-5) means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 turn top-k off (stored as 0)."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    """None: generate until the model's max_model_len."""
    min_tokens: int = 0
    """EOS and stop_token_ids are blocked until this many tokens have been generated."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Top-N logprobs to return for each generated token (0: only the sampled token's)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last N tokens (vLLM's; -1: as many as max_model_len leaves room
    for, i.e. max_model_len - 1)."""
    prompt_logprobs: int | None = None
    """Top-N logprobs to return for each prompt token (0: only the prompt token's own); such a
    request computes its whole prompt (no prefix-cache hits: cached tokens have no logits)."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    """Token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's
    logit_bias); logprobs still report the model's own distribution."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: sample only these tokens (logprobs still report the model's own distribution)."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    use_beam_search: bool = False
    """vLLM's: a beam search `n` beams wide (engine/beam_search.py) instead of sampling; it
    returns the n best sequences. The fields only sampling reads (temperature, top_p,
    top_k, min_p, seed, penalties, ...) are ignored, with a logged warning."""
    length_penalty: float = 1.0
    """Beam search: a finished sequence scores cum_logprob / length ** length_penalty."""
    early_stopping: bool | str = "never"
    """Beam search: when to stop (transformers' modes): True as soon as n sequences are
    finished, False when a better one is unlikely, "never" when none can come."""
    structured_output: StructuredOutput | None = None
    """Every sampled token keeps the output a prefix of valid JSON (engine/structured_output.py);
    logprobs still report the model's own distribution."""
    logit_bias_arrays: tuple[np.ndarray, np.ndarray] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """logit_bias as (int64 token ids, float32 values), built once: a bias over much of the
    vocabulary is read every step the request runs."""
    _allowed_bitmask: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, lo=1)
        # Values print as repr: a rounded one can read as in range ("in [-2, 2], got 2").
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None:
            # The range torch.Generator.manual_seed accepts.
            self.seed = _int("seed", self.seed, lo=-(2**63), hi=2**64 - 1)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, lo=1)
        self.min_tokens = _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.truncate_prompt_tokens is not None:
            value = _int("truncate_prompt_tokens", self.truncate_prompt_tokens, lo=-1)
            if value == 0:
                raise ValueError("truncate_prompt_tokens must be >= 1 or -1, got 0")
            self.truncate_prompt_tokens = value
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int(
                "prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS
            )
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.logit_bias is not None:
            self.logit_bias_arrays = (
                np.fromiter(self.logit_bias.keys(), np.int64, len(self.logit_bias)),
                np.fromiter(self.logit_bias.values(), np.float32, len(self.logit_bias)),
            )
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError(
                    f"structured_output must be a StructuredOutput, got {self.structured_output!r}"
                )
            # A finished value allows only EOS, which these would block or pass over.
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_output")
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured_output")
        self._check_beam_search()
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            kinds = ", ".join(k.name for k in RequestOutputKind)
            raise ValueError(
                f"output_kind must be one of {kinds}, got {self.output_kind!r}"
            ) from None

    def _check_beam_search(self) -> None:
        self.use_beam_search = _bool("use_beam_search", self.use_beam_search)
        self.length_penalty = _float("length_penalty", self.length_penalty)
        early = self.early_stopping
        if not (isinstance(early, bool) or early == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early!r}")
        if not self.use_beam_search:
            return
        # Each beam offers its 2n best next tokens: logprobs of 2n.
        if self.n > MAX_LOGPROBS // 2:
            raise ValueError(
                f"n must be <= {MAX_LOGPROBS // 2} with use_beam_search (the beam width), "
                f"got {self.n}"
            )
        if self.structured_output is not None:
            raise ValueError("structured_output cannot be combined with use_beam_search")

    def allowed_bitmask(self, vocab_size: int) -> np.ndarray | None:
        """allowed_token_ids as int32 words, bit i of word w for token 32w + i (built once)."""
        if self.allowed_token_ids is None:
            return None
        words = (vocab_size + 31) // 32
        mask = self._allowed_bitmask
        if mask is None or len(mask) != words:
            bits = np.zeros(words, dtype=np.uint32)
            ids = np.asarray(self.allowed_token_ids, dtype=np.int64)
            np.bitwise_or.at(bits, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
            mask = self._allowed_bitmask = bits.view(np.int32)
        return mask

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def reads_token_history(self) -> bool:
        """Sampling reads the request's previous tokens (the penalties); the runner adds
        the one still in flight on the device. min_tokens needs only their count."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM


def _int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    # An exact int skips the ABC check (microseconds a request); bool is an int subclass,
    # and `max_tokens=True` is a caller bug, not 1.
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def _float(name: str, value: object) -> float:
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        try:
            value = float(value)
        except OverflowError:
            raise ValueError(
                f"{name} must be a finite number, got an int past float's range"
            ) from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple):
        raise ValueError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain non-empty strings, got {s!r}")
    return list(stop)


def _token_ids(name: str, ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list | tuple):
        raise ValueError(f"{name} must be a list of int, got {type(ids).__name__}")
    # Within int64, like logit_bias: the ids become int64 arrays (the engine checks the vocabulary).
    return [_int(name, i, lo=0, hi=2**63 - 1) for i in ids]


MAX_LOGIT_BIAS = 100.0


def _logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(
            f"logit_bias must be a dict of token id -> number, got {type(bias).__name__}"
        )
    checked = {}
    for token, value in bias.items():
        # Within int64: the ids become an int64 array (the engine checks the vocabulary).
        token = _int("logit_bias token id", token, lo=0, hi=2**63 - 1)
        value = _float("logit_bias value", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be in [-100, 100], got {value!r} for token {token}"
            )
        checked[token] = value
    return checked or None


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last `keep` prompt tokens (truncate_prompt_tokens; -1: max_model_len - 1)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len - 1
    elif keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens ({keep}) must be <= max_model_len ({max_model_len})"
        )
    return ids[-keep:] if len(ids) > keep else ids
