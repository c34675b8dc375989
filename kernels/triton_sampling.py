"""Temperature sampling in one pass over the logits: the Gumbel-max trick.

argmax_i(l_i / T + G_i), G_i = -log(-log(U_i)) with U_i uniform, picks token i with
probability softmax(l / T)_i: the same distribution as the sampler's exponential race
(argmax p_i / E_i, E_i = -log U_i), without the float32 copy, the softmax and the noise
tensor (about seven passes over a [B, V] float32 array; bench/RESULTS.md has the time
they took). Greedy rows take argmax(l). Noise comes from Philox keyed by a seed the
caller draws per step and by (row, token), so it needs no state on the device.

Each program reduces one chunk of one row to its best (score, token); a torch argmax over
the chunks finishes the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192


@triton.jit(do_not_specialize=["seed"])
def _gumbel_argmax_kernel(
    logits_ptr,
    temperature_ptr,
    greedy_ptr,
    best_score_ptr,
    best_id_ptr,
    seed,
    vocab_size,
    stride_l,
    num_chunks,
    HAS_GREEDY: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = 1.0
    greedy = ALL_GREEDY
    if not ALL_GREEDY:
        temperature = tl.load(temperature_ptr + row)
        if HAS_GREEDY:
            greedy = tl.load(greedy_ptr + row) != 0
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    base = chunk * CHUNK
    for start in range(0, tl.minimum(CHUNK, vocab_size - base), BLOCK):
        cols = base + start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        logit = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=mask)
        score = logit.to(tl.float32)
        if not greedy:
            u = tl.rand(seed + row, cols)
            score = score / temperature - tl.log(-tl.log(u))
        score = tl.where(mask, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
    top = tl.max(best, axis=0)
    # The lowest token id among the ties, as torch.argmax picks.
    top_id = tl.min(tl.where(best == top, best_id, vocab_size), axis=0)
    tl.store(best_score_ptr + row * num_chunks + chunk, top)
    tl.store(best_id_ptr + row * num_chunks + chunk, top_id)


def gumbel_sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    greedy: torch.Tensor | None,
    seed: int,
    vocab_size: int | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """One token id per row of `logits` [B, V'] (int64 [B]), reading its first `vocab_size`
    columns. temperature [B] or [B, 1] (greedy rows: any positive value), None: every row
    greedy; greedy [B] bool. `chunk`: vocabulary entries per program, a multiple of 1024."""
    num_rows = logits.shape[0]
    vocab_size = logits.shape[1] if vocab_size is None else vocab_size
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    all_greedy = temperature is None
    if all_greedy:
        temperature = greedy = logits  # unread
    else:
        temperature = temperature.reshape(num_rows).to(torch.float32)
    num_chunks = triton.cdiv(vocab_size, chunk)
    best_score = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_id = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(num_rows, num_chunks)](
        logits,
        temperature,
        greedy if greedy is not None else temperature,
        best_score,
        best_id,
        seed,
        vocab_size,
        logits.stride(0),
        num_chunks,
        HAS_GREEDY=greedy is not None,
        ALL_GREEDY=all_greedy,
        CHUNK=chunk,
        BLOCK=1024,
        num_warps=4,
    )
    winner = best_score.argmax(dim=1, keepdim=True)
    return best_id.gather(1, winner).squeeze(1).to(torch.int64)


def argmax_triton(logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """logits[:, :vocab_size].argmax(dim=1) (the lowest id among ties), spread over the
    vocabulary: torch's argmax of one row runs in few blocks."""
    return gumbel_sample_triton(logits, None, None, 0, vocab_size)
