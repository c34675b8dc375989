"""Turns one step's logits into tokens: greedy / temperature / top-k / top-p / min-p sampling
with per-request seeds, and logprobs.

The model runner builds a `SamplingBatch` once per step (sampling_batch.py) and calls
`sample()`. Every row is processed by batched kernel chains (the logit changes in
logits_processing.py, then the draw: from the top-k candidates for rows with a top_k,
sampling_candidates.py, over the whole vocabulary for the others); only the random draws of
seeded rows loop, each on its request's own generator. On a GPU, plain temperature sampling (no top-k/top-p/min-p,
penalties, min_tokens, logprobs or seeded rows) is one Triton pass instead. The one host sync
is the final copy of the sampled ids (and logprobs) back to Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprobs
from engine.worker.host_staging import to_host_async
from engine.worker.logits_processing import (
    adjust_logits,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    changes_logits,
)
from engine.worker.sampling_batch import (
    SamplingBatch,
    build_sampling_batch,
    held_back_below_min_tokens,
)
from engine.worker.sampling_candidates import sample_candidates
from kernels import use_triton

__all__ = [
    "LogprobTensors",
    "SamplerResult",
    "SamplingBatch",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "build_sampling_batch",
    "finish_sampling",
    "held_back_below_min_tokens",
    "prompt_logprob_tensors",
    "random_sample",
    "sample",
    "sample_on_device",
    "sample_whole_vocabulary",
    "token_logprobs_of",
]


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
    logits: torch.Tensor, batch: SamplingBatch, *, top_k_candidates: bool = True
) -> tuple[torch.Tensor, LogprobTensors | None]:
    """(sampled ids [B], their logprobs or None) without waiting for the device.

    Logprobs are of the model's distribution (before penalties, biases, temperature and
    filters), reduced to what the requests asked for before this returns: launched with
    the step, they are ready when its tokens are.

    Random rows with a top_k sample from their top-k candidates (sampling_candidates.py);
    the others over the whole vocabulary. `top_k_candidates=False` sends every row the
    whole-vocabulary way: the reference the candidates are tested and timed against.
    """
    if _one_pass_eligible(logits, batch):
        from kernels import gumbel_sample

        # Seeded rows keep their generators (below); the others draw from the global one.
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        sampled = gumbel_sample(logits, batch.temperature, batch.greedy, seed, batch.vocab_size)
        return sampled, None
    if _greedy_pass_eligible(logits, batch):
        from kernels import argmax

        return argmax(logits, batch.vocab_size), None
    logits = logits[:, : batch.vocab_size]
    raw_logprobs = None
    if batch.max_num_logprobs is not None:
        raw_logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    owned = changes_logits(batch)
    if owned:
        # A private float32 copy: the changes work in place, the caller's logits stay intact.
        logits = adjust_logits(logits.to(torch.float32, copy=True), batch)
    else:
        logits = logits.to(torch.float32)  # no copy when already float32: only read below

    if batch.all_greedy:
        sampled = logits.argmax(dim=-1)
    else:
        greedy_ids = logits.argmax(dim=-1) if batch.greedy is not None else None
        if top_k_candidates and batch.candidates is not None:
            sampled = _sample_by_row_groups(logits, batch)
        else:
            sampled = sample_whole_vocabulary(logits if owned else logits.clone(), batch)
        if greedy_ids is not None:
            sampled = torch.where(batch.greedy, greedy_ids, sampled)

    if raw_logprobs is None:
        return sampled, None
    return sampled, _logprob_tensors(raw_logprobs, sampled, batch.max_num_logprobs)


def _sample_by_row_groups(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k candidates for the rows with a top_k (and greedy rows, whose draws are replaced),
    the whole vocabulary for the others; `logits` is only read."""
    plan = batch.candidates
    if plan.row_groups is None:
        return sample_candidates(logits, batch)
    candidate_rows, whole_rows = plan.row_groups
    sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    part = batch.select_rows(candidate_rows, plan.candidate_rows(logits.shape[0]))
    sampled.index_copy_(0, candidate_rows, sample_candidates(logits[candidate_rows], part))
    part = batch.select_rows(whole_rows, plan.whole_rows, plan.whole_filters)
    # Indexing copies: the whole-vocabulary chain may work in place.
    sampled.index_copy_(0, whole_rows, sample_whole_vocabulary(logits[whole_rows], part))
    return sampled


def sample_whole_vocabulary(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k / top-p (a sort of [B, V]), min-p, softmax and the exponential race
    over every token; works in place on `logits` [B, V] float32."""
    logits.div_(batch.temperature)
    logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    return random_sample(logits.softmax(dim=-1), batch.generators)


def _logits_used_as_is(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """On a GPU, with no logprobs to report and nothing (min_tokens, penalties, logit_bias)
    to change in the logits before sampling: the Triton passes below can read them directly."""
    return use_triton(logits) and batch.max_num_logprobs is None and not changes_logits(batch)


def _greedy_pass_eligible(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Greedy rows only: a Triton argmax."""
    return batch.all_greedy and _logits_used_as_is(logits, batch)


def _one_pass_eligible(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Temperature sampling with no filter and no seeded row: one Triton pass
    (kernels.gumbel_sample) instead of the chain below."""
    return (
        not batch.all_greedy
        and _logits_used_as_is(logits, batch)
        and batch.top_k is None
        and batch.top_p is None
        and batch.min_p is None
        and not batch.generators
    )


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
