"""Sampling from each row's top-k candidates instead of the whole vocabulary.

For the random rows with a top_k (at most MAX_CANDIDATE_TOP_K), one `torch.topk` of the
step's largest k (plus TIE_SLACK) reads their [B, V] logits once (a radix select, no
sort), and everything after it (temperature, the top-k cut, top-p, min-p, the softmax
and the exponential race) works on [B, F] candidates, F about k. The whole-vocabulary
chain (sampler.sample_whole_vocabulary), kept for the other rows, sorts [B, V] for top-p
and makes a dozen more passes over it.

The kept tokens are those of the whole-vocabulary chain: top-k (ties with the k-th value
kept) on the logits divided by the temperature, then top-p over the renormalized top-k,
then min-p, with the same float32 operations on the same values. Two differences, both
only among exactly equal logits:
- tokens tied with a row's k-th value are all kept only while they fit in the TIE_SLACK
  extra candidates; past that, torch.topk picks which of them are kept;
- at the top-p boundary, tokens of equal probability are cut in torch.topk's order
  rather than the full sort's (neither order is specified among equal values).

Seeded rows draw the same exponential noise as the whole-vocabulary chain (one value per
vocabulary entry from the row's generator) and read it at their candidates, so they pick
the same token; other rows draw noise for their candidates only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.worker.candidate_plan import candidate_count
from engine.worker.host_staging import host_to_device

if TYPE_CHECKING:
    from engine.worker.sampling_batch import SamplingBatch


def filter_candidates(
    logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, F], token ids [B, F]): each row's top F logits divided by its temperature,
    most likely first, with -inf where top-k, top-p or min-p drops the token.

    `logits` [B, V] float32 is only read. Greedy rows' scores are meaningless (their top_k
    may exceed F); the caller replaces their draws.
    """
    if batch.candidates is None or batch.top_k is None:
        raise ValueError("candidates: filter_candidates needs a step with top-k rows")
    fetch = candidate_count(batch.candidates.max_top_k, logits.shape[-1])
    values, ids = logits.topk(fetch, dim=-1)
    # Dividing by T > 0 keeps the order; divided before the cut, as the reference does, so
    # that values the division makes equal are tied there too.
    scores = values.div_(batch.temperature)
    k = batch.top_k.clamp(max=fetch)
    kth = scores.gather(1, (k - 1).unsqueeze(1))
    scores.masked_fill_(scores < kth, float("-inf"))
    if batch.top_p is not None:
        probs = scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # As the reference: p == 1 rows are exempt (rounding), the top token always stays.
        outside = (mass_before >= batch.top_p.unsqueeze(1)) & (batch.top_p < 1.0).unsqueeze(1)
        outside[:, 0] = False
        scores.masked_fill_(outside, float("-inf"))
    if batch.min_p is not None:
        # The row's largest score is candidate 0 (top-k and top-p always keep it).
        threshold = scores[:, :1] + batch.min_p.log().unsqueeze(1)
        scores.masked_fill_(scores < threshold, float("-inf"))
    return scores, ids


def sample_candidates(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token id per row [B] int64, drawn from the row's filtered candidates with the
    exponential race (argmax p_i / E_i)."""
    scores, ids = filter_candidates(logits, batch)
    probs = scores.softmax(dim=-1)
    noise = torch.empty_like(probs)
    if len(batch.generators) < probs.shape[0]:
        noise.exponential_()
    if batch.generators:
        seeded = list(batch.generators)
        # The whole-vocabulary chain's draw, value for value: one per token from the row's
        # generator, read here at the row's candidates.
        full = torch.empty(len(seeded), logits.shape[-1], device=logits.device)
        for row, gen in zip(full.unbind(0), batch.generators.values(), strict=True):
            row.exponential_(generator=gen)
        rows = host_to_device(torch.tensor(seeded), logits.device)
        noise.index_copy_(0, rows, full.gather(1, ids.index_select(0, rows)))
    # An exact 0 draw would turn a dropped token's 0 / 0 into NaN, which argmax prefers.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    winner = probs.div_(noise).argmax(dim=-1, keepdim=True)
    return ids.gather(1, winner).squeeze(1)
