"""What one scheduler step has left to give, and what it gave so far."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepBudget:
    """What one step has left to give and what it gave so far."""

    tokens: int
    prefill_tokens: int
    max_seqs: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    prefilling: set[str] = field(default_factory=set)
    preempted: bool = False

    def take(self, request_id: str, num_tokens: int, is_prefill: bool) -> None:
        self.num_scheduled[request_id] = num_tokens
        self.tokens -= num_tokens
        if is_prefill:
            self.prefilling.add(request_id)
            self.prefill_tokens -= num_tokens

    def refund(self, request_id: str) -> None:
        """Give back what a request preempted in this step had been given."""
        if request_id not in self.num_scheduled:
            return
        num_tokens = self.num_scheduled.pop(request_id)
        self.tokens += num_tokens
        if request_id in self.prefilling:
            self.prefilling.discard(request_id)
            self.prefill_tokens += num_tokens
        self.new_block_ids.pop(request_id)
