"""What a step's requests change in their logits before the draw: logit bias, allowed tokens
(structured output), min_tokens, repetition / frequency / presence penalties, and the top-k,
top-p and min-p filters. Each works on the float32 copy the sampler owns (sampler.py).
"""

from __future__ import annotations

import math

import torch

from engine.worker.sampling_batch import SamplingBatch


def changes_logits(batch: SamplingBatch) -> bool:
    """Whether adjust_logits has anything to change in this step's logits."""
    return (
        batch.logit_bias is not None
        or batch.allowed_tokens is not None
        or batch.min_tokens_mask is not None
        or batch.output_token_counts is not None
    )


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, allowed tokens, tokens held back below min_tokens, then penalties: each
    only where some row asked for it. Works in place where it can; use the result."""
    if batch.logit_bias is not None:
        rows, tokens, values = batch.logit_bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if batch.allowed_tokens is not None:
        rows, words = batch.allowed_tokens
        logits[rows] = logits[rows].masked_fill(~unpack_bitmask(words, logits.shape[-1]), -math.inf)
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
    return logits


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [R, W] -> bool [R, vocab_size]; tokens past the words are not allowed."""
    bits = (words.unsqueeze(-1) >> _BITS.to(words.device)) & 1
    allowed = bits.view(words.shape[0], -1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed


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
