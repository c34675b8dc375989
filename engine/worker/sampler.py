"""Turns one step's logits into tokens: penalties, greedy / temperature / top-k / top-p / min-p
sampling with per-request seeds, and logprobs.

The model runner builds a `SamplingBatch` once per step (host lists -> device tensors) and
calls `sample()`. Every row is processed by one batched kernel chain; only the random draws
of seeded rows loop, each on its request's own generator. On a GPU, plain temperature
sampling (no top-k/top-p/min-p, penalties, min_tokens, logprobs or seeded rows) is one
Triton pass instead. The one host sync is the final copy of the sampled ids (and logprobs)
back to Python.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.worker.host_staging import to_host_async
from kernels import use_triton


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


@dataclass
class LogprobTensors:
    """Per row, on the device until `to_host`: the sampled token's logprob and rank (1 = the
    most likely) and the top-N candidates, N the batch's largest request."""

    sampled: torch.Tensor
    """[B] float32."""
    ranks: torch.Tensor
    """[B] int64."""
    top_logprobs: torch.Tensor
    """[B, N] float32, most likely first."""
    top_ids: torch.Tensor
    """[B, N] int64."""

    def to_host(self) -> LogprobTensors:
        """Copies in pinned memory, started without waiting (sync the stream before reading)."""
        return LogprobTensors(*(to_host_async(t) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.sampled, self.ranks, self.top_logprobs, self.top_ids)


@dataclass
class SamplerResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


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
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        if any(greedy):
            batch.greedy = _tensor(greedy, torch.bool, device)
        batch.temperature = _tensor(
            [[1.0 if g else p.temperature] for p, g in zip(params, greedy, strict=True)],
            torch.float32,
            device,
        )
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

    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    use_frequency = any(p.frequency_penalty != 0.0 for p in params)
    use_presence = any(p.presence_penalty != 0.0 for p in params)
    if use_repetition or use_frequency or use_presence:
        counts = _token_histogram(output_token_ids, vocab_size, device)
        batch.output_token_counts = counts
        if use_repetition:
            batch.repetition_penalty = _column([p.repetition_penalty for p in params], device)
            batch.prompt_token_mask = _token_histogram(prompt_token_ids, vocab_size, device) > 0
        if use_frequency:
            batch.frequency_penalty = _column([p.frequency_penalty for p in params], device)
        if use_presence:
            batch.presence_penalty = _column([p.presence_penalty for p in params], device)

    rows: list[int] = []
    cols: list[int] = []
    for i, (p, num_out) in enumerate(zip(params, num_output_tokens, strict=True)):
        if num_out >= p.min_tokens:
            continue
        for t in held_back_below_min_tokens(p, eos_token_id):
            if t < vocab_size:
                rows.append(i)
                cols.append(t)
    if rows:
        batch.min_tokens_mask = (
            _tensor(rows, torch.int64, device),
            _tensor(cols, torch.int64, device),
        )
    biased = [(i, p.logit_bias_arrays) for i, p in enumerate(params) if p.logit_bias_arrays]
    if biased:
        sizes = [len(ids) for _, (ids, _) in biased]
        batch.logit_bias = (
            _from_numpy(np.repeat([i for i, _ in biased], sizes), device),
            _from_numpy(np.concatenate([ids for _, (ids, _) in biased]), device),
            _from_numpy(np.concatenate([values for _, (_, values) in biased]), device),
        )
    masks = list(token_bitmasks) if token_bitmasks else []
    allowed = [(i, p) for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed:  # allowed_token_ids: a fixed mask, and-ed with the row's grammar mask if any
        masks = masks or [None] * num_rows
        for i, p in allowed:
            mask = p.allowed_bitmask(vocab_size)
            masks[i] = mask if masks[i] is None else masks[i] & mask
    masked = [(i, m) for i, m in enumerate(masks) if m is not None]
    if masked:
        batch.allowed_tokens = (
            _tensor([i for i, _ in masked], torch.int64, device),
            _from_numpy(np.stack([m for _, m in masked]), device),
        )
    return batch


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerResult:
    """Sample one token per row of `logits` [B, V'] (V' >= vocab_size; padding is dropped)."""
    sampled, logprobs = sample_on_device(logits, batch)
    return finish_sampling(sampled, logprobs, batch)


def finish_sampling(
    sampled: torch.Tensor, logprobs: LogprobTensors | None, batch: SamplingBatch
) -> SamplerResult:
    """The host side of sampling: token ids (and logprobs) as Python values; syncs."""
    token_ids = sampled.tolist()
    return SamplerResult(token_ids, _token_logprobs(logprobs, token_ids, batch))


def sample_on_device(
    logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, LogprobTensors | None]:
    """(sampled ids [B], their logprobs or None) without waiting for the device.

    Logprobs are of the model's distribution (before penalties, biases, temperature and
    filters), reduced to what the requests asked for before this returns: launched with
    the step, they are ready when its tokens are."""
    if _one_pass_eligible(logits, batch):
        from kernels.triton_sampling import gumbel_sample_triton

        # Seeded rows keep their generators (below); the others draw from the global one.
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        sampled = gumbel_sample_triton(
            logits, batch.temperature, batch.greedy, seed, batch.vocab_size
        )
        return sampled, None
    if _greedy_pass_eligible(logits, batch):
        from kernels.triton_sampling import argmax_triton

        return argmax_triton(logits, batch.vocab_size), None
    # A private float32 copy: everything below works in place, the caller's logits stay intact.
    logits = logits[:, : batch.vocab_size].to(torch.float32, copy=True)
    raw_logprobs = logits.log_softmax(dim=-1) if batch.max_num_logprobs is not None else None

    if batch.logit_bias is not None:
        rows, tokens, values = batch.logit_bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if batch.allowed_tokens is not None:
        rows, words = batch.allowed_tokens
        logits[rows] = logits[rows].masked_fill(
            ~_unpack_bitmask(words, logits.shape[-1]), -math.inf
        )
    if batch.min_tokens_mask is not None:
        logits[batch.min_tokens_mask] = float("-inf")
    if batch.output_token_counts is not None:
        logits = apply_penalties(
            logits,
            batch.output_token_counts,
            batch.prompt_token_mask,
            batch.repetition_penalty,
            batch.frequency_penalty,
            batch.presence_penalty,
        )

    if batch.all_greedy:
        sampled = logits.argmax(dim=-1)
    else:
        greedy_ids = logits.argmax(dim=-1) if batch.greedy is not None else None
        logits.div_(batch.temperature)
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        sampled = random_sample(logits.softmax(dim=-1), batch.generators)
        if greedy_ids is not None:
            sampled = torch.where(batch.greedy, greedy_ids, sampled)

    if raw_logprobs is None:
        return sampled, None
    return sampled, _logprob_tensors(raw_logprobs, sampled, batch.max_num_logprobs)


_BITS = torch.arange(32, dtype=torch.int32)


def _unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [R, W] -> bool [R, vocab_size]; tokens past the words are not allowed."""
    bits = (words.unsqueeze(-1) >> _BITS.to(words.device)) & 1
    allowed = bits.view(words.shape[0], -1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed


def _logits_used_as_is(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """On a GPU, with no logprobs to report and nothing (min_tokens, penalties, logit_bias)
    to change in the logits before sampling: the Triton passes below can read them directly."""
    return (
        use_triton(logits)
        and batch.max_num_logprobs is None
        and batch.min_tokens_mask is None
        and batch.output_token_counts is None
        and batch.logit_bias is None
        and batch.allowed_tokens is None
    )


def _greedy_pass_eligible(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Greedy rows only: a Triton argmax."""
    return batch.all_greedy and _logits_used_as_is(logits, batch)


def _one_pass_eligible(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Temperature sampling with no filter and no seeded row: one Triton pass
    (kernels/triton_sampling.py) instead of the chain below."""
    return (
        not batch.all_greedy
        and _logits_used_as_is(logits, batch)
        and batch.top_k is None
        and batch.top_p is None
        and batch.min_p is None
        and not batch.generators
    )


def held_back_below_min_tokens(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    """The ids a request may not sample before min_tokens: those that would end it."""
    held = list(params.stop_token_ids)
    # With ignore_eos, EOS does not end the request, so there is nothing to hold back.
    if eos_token_id is not None and not params.ignore_eos:
        held.append(eos_token_id)
    return held


def apply_penalties(
    logits: torch.Tensor,
    output_token_counts: torch.Tensor,
    prompt_token_mask: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (CTRL: divide positive logits, multiply
    negative ones); frequency and presence penalties over output tokens only (OpenAI)."""
    output_mask = output_token_counts > 0
    if repetition_penalty is not None:
        seen = output_mask if prompt_token_mask is None else output_mask | prompt_token_mask
        scale = torch.where(seen, repetition_penalty, 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
        # A penalty near 0 (1e-39 is valid) overflows seen positive logits to +inf, and a
        # softmax over several infinities is NaN: keep them the largest finite value instead.
        logits.clamp_(max=torch.finfo(logits.dtype).max)
    if frequency_penalty is not None:
        logits -= frequency_penalty * output_token_counts
    if presence_penalty is not None:
        logits -= presence_penalty * output_mask
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf what falls outside each row's top-k, then outside its top-p nucleus.

    top_k: [B] int64, vocab_size = off. Ties with the k-th logit are kept.
    top_p: [B], 1.0 = off. The nucleus is the smallest set of most likely tokens (after top-k)
    whose probability reaches p; the most likely token is always kept.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rounding can push the cumulative sum past 1.0, so rows with p == 1 are exempt.
        outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        # A p that rounds to 0 in float32 (1e-50) would leave no token at all.
        outside[:, 0] = False
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * (the row's top probability).

    Compared in log space: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))


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


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from `probs` [B, V] with the exponential race:
    argmax(p_i / E_i), E_i ~ Exp(1), picks token i with probability p_i.

    Seeded rows draw their E from their own generator, so their tokens depend only on their
    seed and their own logits, never on the rest of the batch.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # An exact 0 draw would turn a masked token's 0 / 0 into NaN, which argmax prefers.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def _logprob_tensors(logprobs: torch.Tensor, sampled: torch.Tensor, n: int) -> LogprobTensors:
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(n, dim=-1)
    return LogprobTensors(sampled_logprobs.squeeze(1), ranks, top_logprobs, top_ids)


def prompt_logprob_tensors(logits: torch.Tensor, targets: torch.Tensor, n: int) -> LogprobTensors:
    """Each row's logprob of its target (the prompt's next token), its rank, and the top n."""
    return _logprob_tensors(logits.log_softmax(dim=-1), targets, n)


def token_logprobs_of(tensors: LogprobTensors, token_ids: list[int]) -> list[TokenLogprobs]:
    """Host tensors (every row with the same top-N) -> one TokenLogprobs per row."""
    chosen, ranks, top_lp, top_ids = (t.tolist() for t in tensors.tensors())
    return [
        TokenLogprobs(token_ids[i], chosen[i], ranks[i], dict(zip(top_ids[i], top_lp[i])))
        for i in range(len(token_ids))
    ]


def _token_logprobs(
    logprobs: LogprobTensors | None, token_ids: list[int], batch: SamplingBatch
) -> list[TokenLogprobs | None]:
    if logprobs is None:
        return [None] * len(batch.num_logprobs)
    sampled_list, ranks_list, top_lp_list, top_ids_list = (t.tolist() for t in logprobs.tensors())
    out: list[TokenLogprobs | None] = []
    for i, n in enumerate(batch.num_logprobs):
        if n is None:
            out.append(None)
            continue
        top = dict(zip(top_ids_list[i][:n], top_lp_list[i][:n], strict=True))
        out.append(TokenLogprobs(token_ids[i], sampled_list[i], ranks_list[i], top))
    return out


def _from_numpy(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return _to_device(torch.from_numpy(array), device)


def _tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(data, dtype=dtype), device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


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
