"""CUDA graphs for decode-only steps: one graph per bucketed batch size.

A decode step is a few hundred small kernels; replaying a captured graph removes their
launch gaps. Graphs read their inputs from static buffers, so a step copies its tensors
into the first `n` rows, pads the rest of the bucket (slot -1: nothing stored; context 1
over the null block), replays and reads the first `n` rows of the output.
"""

from __future__ import annotations

import torch

from engine.forward_context import AttentionMetadata, forward_context
from engine.worker.graph_inputs import copy_step_in, static_token_buffers

MAX_CAPTURE_SIZE = 512
"""Larger decode batches run eagerly: their launches are a small share of the step."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, 8] + list(range(16, largest + 1, 16))
    return sorted({s for s in sizes if s <= largest} | {largest})


class DecodeCudaGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        self.input_ids, self.positions, self.slot_mapping = static_token_buffers(n, device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.output = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            # Graphs are reused for every context length: kernels size for the longest.
            max_seq_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller graphs reuse the first one's memory pool.
        for bs in reversed(self.sizes):
            meta = self._meta(bs)
            with forward_context(meta):
                self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up / autotune
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), forward_context(meta):
                self.output[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_reqs: int, max_query_len: int, block_table_width: int) -> bool:
        return (
            max_query_len == 1
            and num_reqs <= self.sizes[-1]
            and block_table_width <= self.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        per_request = [(self.seq_lens, meta.seq_lens, 1), (self.block_tables, meta.block_tables, 0)]
        n, bs = copy_step_in(self, input_ids, positions, meta, extra=per_request)
        self.graphs[bs].replay()
        return self.output[:n]
