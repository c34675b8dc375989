"""One scheduled step as flat tensors: token ids, positions, KV slots, attention metadata and
the rows whose logits are sampled.

Requests are laid end to end in the scheduler's batch order. A request's last input token
may be one the step before sampled and the host has not seen yet: its row is filled on the
device from those samples (`BatchInputs.pending_token_rows`), so building the next step
need not wait for the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.forward_context import AttentionMetadata
from engine.worker.host_staging import HostToDevice
from engine.worker.request_states import RequestStates


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    """Row of the hidden states whose logits are sampled, one per sampling request."""
    sampling_req_ids: list[str] = field(default_factory=list)
    pending_token_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows of input_ids, rows of the previous step's samples) for tokens the host has not
    seen yet: copied on the device, so scheduling need not wait for the last step."""


def build_batch_inputs(
    out: SchedulerOutput,
    requests: RequestStates,
    in_flight_rows: dict[str, int],
    h2d: HostToDevice,
    block_size: int,
) -> BatchInputs:
    """`in_flight_rows`: request -> its row in the previous step's samples, still on the
    device."""
    bs = block_size
    states = [requests[r] for r in out.num_scheduled_tokens]
    host = _HostBatch.empty(
        num_reqs=len(states),
        num_tokens=out.total_num_scheduled_tokens,
        width=max(len(s.block_ids) for s in states),
    )
    input_ids, positions, slots = host.input_ids, host.positions, host.slots
    block_tables = host.block_tables
    offset = 0
    for i, (state, n) in enumerate(zip(states, out.num_scheduled_tokens.values())):
        if n == 1 and host.num_decodes == i:
            host.num_decodes += 1
        start = state.num_computed_tokens
        end = start + n
        blocks = state.block_ids
        block_tables[i, : len(blocks)] = blocks
        num_known = len(state.token_ids)
        if end > num_known:
            # The last input token was sampled by the step before and is still on the device.
            if end != num_known + 1 or state.req_id not in in_flight_rows:
                raise RuntimeError(f"request {state.req_id}: input tokens are missing")
            host.pending_dst.append(offset + n - 1)
            host.pending_src.append(in_flight_rows[state.req_id])
            end_known = num_known
        else:
            end_known = end
        if n == 1:
            input_ids[offset] = state.token_ids[start] if end_known > start else 0
            positions[offset] = start
            slots[offset] = blocks[start // bs] * bs + start % bs
        else:
            pos = np.arange(start, end)
            input_ids[offset : offset + end_known - start] = state.token_ids[start:end_known]
            positions[offset : offset + n] = pos
            slots[offset : offset + n] = block_tables[i, pos // bs] * bs + pos % bs
        offset += n
        host.query_start_loc[i + 1] = offset
        host.seq_lens[i] = end
        if end == num_known + state.num_pending:
            host.logits_indices.append(offset - 1)
            host.sampling_req_ids.append(state.req_id)
    return host.to_device(h2d, max_query_len=max(out.num_scheduled_tokens.values()))


@dataclass
class _HostBatch:
    """A step's arrays on the host, filled request by request."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    logits_indices: list[int] = field(default_factory=list)
    sampling_req_ids: list[str] = field(default_factory=list)
    pending_dst: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    num_decodes: int = 0
    """Requests at the front with one token each."""

    @classmethod
    def empty(cls, num_reqs: int, num_tokens: int, width: int) -> _HostBatch:
        return cls(
            input_ids=np.empty(num_tokens, dtype=np.int64),
            positions=np.empty(num_tokens, dtype=np.int64),
            slots=np.empty(num_tokens, dtype=np.int64),
            query_start_loc=np.zeros(num_reqs + 1, dtype=np.int32),
            seq_lens=np.empty(num_reqs, dtype=np.int32),
            block_tables=np.zeros((num_reqs, width), dtype=np.int32),
        )

    def to_device(self, h2d: HostToDevice, max_query_len: int) -> BatchInputs:
        meta = AttentionMetadata(
            slot_mapping=h2d(self.slots),
            query_start_loc=h2d(self.query_start_loc),
            seq_lens=h2d(self.seq_lens),
            block_tables=h2d(self.block_tables),
            max_query_len=max_query_len,
            max_seq_len=int(self.seq_lens.max()),
            num_decodes=self.num_decodes,
        )
        return BatchInputs(
            input_ids=h2d(self.input_ids),
            positions=h2d(self.positions),
            attn_metadata=meta,
            logits_indices=h2d(np.array(self.logits_indices, dtype=np.int64)),
            sampling_req_ids=self.sampling_req_ids,
            pending_token_rows=(
                (
                    h2d(np.array(self.pending_dst, dtype=np.int64)),
                    h2d(np.array(self.pending_src, dtype=np.int64)),
                )
                if self.pending_dst
                else None
            ),
        )
