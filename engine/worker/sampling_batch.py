"""A step's sampling settings as device tensors: built once per step from each row's
SamplingParams (host lists -> device tensors), then read by the sampler (sampler.py).

A field that no row of the step needs stays None, so the sampler skips its work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.worker.candidate_plan import ALL_FILTERS, CandidatePlan, plan_candidates
from engine.worker.host_staging import host_to_device


@dataclass
class SamplingBatch:
    """Per-row sampling state for one step. Tensors that no row needs are None."""

    vocab_size: int
    all_greedy: bool
    greedy: torch.Tensor | None = None
    """[B] bool; None when no row, or every row, is greedy."""
    temperature: torch.Tensor | None = None
    """[B, 1]; greedy rows hold 1.0 (their random draw is discarded). None when all greedy."""
    top_k: torch.Tensor | None = None
    """[B] int64; vocab_size where top-k is off."""
    top_p: torch.Tensor | None = None
    """[B]; 1.0 where top-p is off."""
    min_p: torch.Tensor | None = None
    """[B]; 0.0 where min-p is off."""
    repetition_penalty: torch.Tensor | None = None
    """[B, 1]."""
    frequency_penalty: torch.Tensor | None = None
    """[B, 1]."""
    presence_penalty: torch.Tensor | None = None
    """[B, 1]."""
    output_token_counts: torch.Tensor | None = None
    """[B, V] how often each token occurs in the row's output so far."""
    prompt_token_mask: torch.Tensor | None = None
    """[B, V] bool, tokens in the prompt (only the repetition penalty reads it)."""
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) blocked because the row is still below min_tokens."""
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids, float32 values) added to the logits (SamplingParams.logit_bias)."""
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, int32 bitmask words [R, W]): those rows sample only tokens whose bit is set
    (structured output); bit i of word w is token 32w + i."""
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Row -> the request's own generator, for seeded random rows."""
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None
    candidates: CandidatePlan | None = None
    """Which random rows sample from their top-k candidates; None: none of them."""

    def select_rows(
        self,
        rows: torch.Tensor,
        positions: list[int],
        filters: frozenset[str] = ALL_FILTERS,
    ) -> SamplingBatch:
        """The random-sampling settings of rows `positions` (given on the device as `rows`),
        renumbered from 0, for sampling a part of the batch; filters not named in `filters`
        are left off. Greedy rows need no flag: the caller replaces their draws."""

        def pick(t: torch.Tensor | None, name: str = "") -> torch.Tensor | None:
            if t is None or (name and name not in filters):
                return None
            return t.index_select(0, rows)

        new_index = {row: i for i, row in enumerate(positions)}
        return SamplingBatch(
            vocab_size=self.vocab_size,
            all_greedy=False,
            temperature=pick(self.temperature),
            top_k=pick(self.top_k, "top_k"),
            top_p=pick(self.top_p, "top_p"),
            min_p=pick(self.min_p, "min_p"),
            generators={new_index[r]: g for r, g in self.generators.items() if r in new_index},
            candidates=self.candidates and self.candidates.alone(),
        )


def build_sampling_batch(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    eos_token_id: int | None,
    vocab_size: int,
    device: torch.device | str,
    num_output_tokens: list[int] | None = None,
    token_bitmasks: list[np.ndarray | None] | None = None,
) -> SamplingBatch:
    """`num_output_tokens`: tokens each row generated before this one (min_tokens), when
    `output_token_ids` lacks some (in flight) or is left empty (no penalties to apply).
    `token_bitmasks`: per row, the tokens its grammar lets it sample
    (SchedulerOutput.grammar_bitmask); a row's allowed_token_ids narrow that further."""
    device = torch.device(device)
    num_rows = len(params)
    if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows:
        raise ValueError(
            "params, prompt_token_ids, output_token_ids and generators differ in length"
        )
    if num_output_tokens is None:
        num_output_tokens = [len(out) for out in output_token_ids]
    greedy = [p.is_greedy for p in params]
    batch = SamplingBatch(vocab_size=vocab_size, all_greedy=all(greedy))
    batch.num_logprobs = [p.logprobs for p in params]
    requested = [n for n in batch.num_logprobs if n is not None]
    batch.max_num_logprobs = max(requested) if requested else None
    if not batch.all_greedy:
        _add_random_sampling(batch, params, greedy, generators, num_output_tokens, device)
    _add_penalties(batch, params, prompt_token_ids, output_token_ids, device)
    batch.min_tokens_mask = _min_tokens_mask(
        params, num_output_tokens, eos_token_id, vocab_size, device
    )
    batch.logit_bias = _logit_bias(params, device)
    batch.allowed_tokens = _allowed_tokens(params, token_bitmasks, vocab_size, device)
    return batch


def held_back_below_min_tokens(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    """The ids a request may not sample before min_tokens: those that would end it."""
    held = list(params.stop_token_ids)
    # With ignore_eos, EOS does not end the request, so there is nothing to hold back.
    if eos_token_id is not None and not params.ignore_eos:
        held.append(eos_token_id)
    return held


_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """The seed of the draw for a request's `index`-th output token (splitmix64 of the two).

    Each token draws from a stream of its own rather than the next numbers of one stream:
    a request preempted and recomputed is sent to the workers anew, and a generator seeded
    once would then start over, so its tokens after the preemption differed from those it
    draws running through.
    """
    z = ((seed & _MASK64) + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _add_random_sampling(
    batch: SamplingBatch,
    params: list[SamplingParams],
    greedy: list[bool],
    generators: list[torch.Generator | None],
    num_output_tokens: list[int],
    device: torch.device,
) -> None:
    """Temperature, the filters some random row uses, and the seeded rows' generators
    (seeded here for this token's draw)."""
    vocab_size = batch.vocab_size
    random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
    if any(greedy):
        batch.greedy = _tensor(greedy, torch.bool, device)
    batch.temperature = _tensor(
        [[1.0 if g else p.temperature] for p, g in zip(params, greedy, strict=True)],
        torch.float32,
        device,
    )
    batch.candidates = plan_candidates(params, greedy, vocab_size, device)
    if any(p.top_k > 0 for p in random_params):
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        batch.top_k = _tensor([min(k, vocab_size) for k in top_k], torch.int64, device)
    if any(p.top_p < 1.0 for p in random_params):
        batch.top_p = _tensor([p.top_p for p in params], torch.float32, device)
    if any(p.min_p > 0.0 for p in random_params):
        batch.min_p = _tensor([p.min_p for p in params], torch.float32, device)
    batch.generators = {}
    for i, (gen, g) in enumerate(zip(generators, greedy, strict=True)):
        if gen is None or g:
            continue
        if params[i].seed is not None:
            gen.manual_seed(token_seed(params[i].seed, num_output_tokens[i]))
        batch.generators[i] = gen


def _add_penalties(
    batch: SamplingBatch,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    device: torch.device,
) -> None:
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    use_frequency = any(p.frequency_penalty != 0.0 for p in params)
    use_presence = any(p.presence_penalty != 0.0 for p in params)
    if not (use_repetition or use_frequency or use_presence):
        return
    vocab_size = batch.vocab_size
    batch.output_token_counts = _token_histogram(output_token_ids, vocab_size, device)
    if use_repetition:
        batch.repetition_penalty = _column([p.repetition_penalty for p in params], device)
        batch.prompt_token_mask = _token_histogram(prompt_token_ids, vocab_size, device) > 0
    if use_frequency:
        batch.frequency_penalty = _column([p.frequency_penalty for p in params], device)
    if use_presence:
        batch.presence_penalty = _column([p.presence_penalty for p in params], device)


def _min_tokens_mask(
    params: list[SamplingParams],
    num_output_tokens: list[int],
    eos_token_id: int | None,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, num_out) in enumerate(zip(params, num_output_tokens, strict=True)):
        if num_out >= p.min_tokens:
            continue
        for t in held_back_below_min_tokens(p, eos_token_id):
            if t < vocab_size:
                rows.append(i)
                cols.append(t)
    if not rows:
        return None
    return _tensor(rows, torch.int64, device), _tensor(cols, torch.int64, device)


def _logit_bias(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    biased = [(i, p.logit_bias_arrays) for i, p in enumerate(params) if p.logit_bias_arrays]
    if not biased:
        return None
    sizes = [len(ids) for _, (ids, _) in biased]
    return (
        _from_numpy(np.repeat([i for i, _ in biased], sizes), device),
        _from_numpy(np.concatenate([ids for _, (ids, _) in biased]), device),
        _from_numpy(np.concatenate([values for _, (_, values) in biased]), device),
    )


def _allowed_tokens(
    params: list[SamplingParams],
    token_bitmasks: list[np.ndarray | None] | None,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    masks = list(token_bitmasks) if token_bitmasks else []
    allowed = [(i, p) for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed:  # allowed_token_ids: a fixed mask, and-ed with the row's grammar mask if any
        masks = masks or [None] * len(params)
        for i, p in allowed:
            mask = p.allowed_bitmask(vocab_size)
            masks[i] = mask if masks[i] is None else masks[i] & mask
    masked = [(i, m) for i, m in enumerate(masks) if m is not None]
    if not masked:
        return None
    return (
        _tensor([i for i, _ in masked], torch.int64, device),
        _from_numpy(np.stack([m for _, m in masked]), device),
    )


def _from_numpy(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return host_to_device(torch.from_numpy(array), device)


def _tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return host_to_device(torch.tensor(data, dtype=dtype), device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return _tensor([[v] for v in values], torch.float32, device)


def _token_histogram(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] float32 count of each token id per row."""
    lengths = [len(ids) for ids in token_ids]
    # numpy reads a flat iterator of Python ints several times faster than torch.tensor
    # reads nested lists, which matters for long prompts under a repetition penalty.
    flat = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, count=sum(lengths))
    flat += np.repeat(np.arange(len(token_ids), dtype=np.int64) * vocab_size, lengths)
    index = torch.from_numpy(flat)
    if device.type != "cpu":
        index = index.pin_memory().to(device, non_blocking=True)
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts.view(len(token_ids), vocab_size)
