"""Which rows of a step sample from their top-k candidates (sampling_candidates.py), decided
on the host when the step's SamplingBatch is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.worker.host_staging import host_to_device

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

MAX_CANDIDATE_TOP_K = 1024
"""Random rows with a top_k up to this sample from torch.topk's candidates; rows with a
larger top_k (or none) take the whole-vocabulary chain."""

ALL_FILTERS = frozenset({"top_k", "top_p", "min_p"})

TIE_SLACK = 64
"""Candidates fetched past the batch's largest top_k, so that tokens tied with a row's
k-th logit (frequent with bfloat16 logits) are kept as the whole-vocabulary chain keeps
them."""


@dataclass
class CandidatePlan:
    """Which rows of a step sample from their top-k candidates, decided on the host when
    the step's SamplingBatch is built, so that the sampler never waits for the device."""

    max_top_k: int
    """The largest top_k of the candidate rows: the step fetches it plus TIE_SLACK."""
    whole_rows: list[int]
    """Random rows without a top_k of at most MAX_CANDIDATE_TOP_K: the whole vocabulary."""
    whole_filters: frozenset[str] = frozenset()
    """The filters ("top_k", "top_p", "min_p") some whole-vocabulary row uses."""
    row_groups: tuple[torch.Tensor, torch.Tensor] | None = None
    """(candidate rows, whole-vocabulary rows) on the device when whole_rows is not empty;
    greedy rows go with the candidates (their draws are replaced)."""

    def candidate_rows(self, num_rows: int) -> list[int]:
        whole = set(self.whole_rows)
        return [i for i in range(num_rows) if i not in whole]

    def alone(self) -> CandidatePlan:
        """The plan of the candidate rows taken apart."""
        return CandidatePlan(self.max_top_k, [])


def plan_candidates(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
) -> CandidatePlan | None:
    """None when no random row has a top_k of at most MAX_CANDIDATE_TOP_K."""
    random_rows = [i for i, g in enumerate(greedy) if not g]
    usable = {i for i in random_rows if 0 < params[i].top_k <= MAX_CANDIDATE_TOP_K}
    if not usable:
        return None
    max_top_k = min(max(params[i].top_k for i in usable), vocab_size)
    whole_rows = [i for i in random_rows if i not in usable]
    if not whole_rows:
        return CandidatePlan(max_top_k, [])
    whole = [params[i] for i in whole_rows]
    used = {
        "top_k": any(p.top_k > MAX_CANDIDATE_TOP_K for p in whole),
        "top_p": any(p.top_p < 1.0 for p in whole),
        "min_p": any(p.min_p > 0.0 for p in whole),
    }
    plan = CandidatePlan(max_top_k, whole_rows, frozenset(k for k, v in used.items() if v))
    plan.row_groups = (
        host_to_device(torch.tensor(plan.candidate_rows(len(params))), device),
        host_to_device(torch.tensor(whole_rows), device),
    )
    return plan


def candidate_count(max_top_k: int, vocab_size: int) -> int:
    return min(vocab_size, max_top_k + TIE_SLACK)
