"""Vocab-parallel token embedding and LM head.

The vocabulary is split into tp equal ranges (the last one padded past vocab_size); a rank
looks up only its own tokens, and the partial embeddings are summed across ranks. The head
computes its range of logits and the ranges are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import (
    get_tp_rank,
    get_tp_size,
    sequence_reduce_scatter,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from engine.layers.linear import check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim))
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded_weight[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """[T] -> [T, H]; with sequence_parallel, this rank's rows (sequence_shard) of it."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, 0)
        y = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        if sequence_parallel:
            return sequence_reduce_scatter(y)
        return tensor_model_parallel_all_reduce(y)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, tp={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, H] -> logits [N, vocab]; tie it to an embedding by sharing `weight`."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]
