"""CUDA graphs for steps that hold prefills, split at attention ("piecewise" graphs).

A step with a prefill runs about ten kernels a layer. Launched one by one from Python they
cost more CPU time than a short prefill takes on the GPU, so such a step waits for its
launches, and a slower host makes a slower first token. Here everything but the paged
attention is captured per bucketed token count, as one graph for each stretch between two
attention calls. A step copies its tokens into the first `n` rows of static buffers, marks
the bucket's other rows as storing nothing (slot -1), then replays graph 0, runs layer 0's
attention eagerly with the step's own metadata, replays graph 1, and so on. Attention
stays out of the graphs because its grid follows the batch's requests, which a token
count does not fix; decode-only steps keep their whole-forward graphs (cuda_graphs.py).

Rows past `n` carry stale values through the graphs. Every captured operation works row
by row (GEMMs, norms, the activation, the rotary store, a tensor-parallel all-reduce adds
row to row), and no request owns those rows in the attention, so they never reach a real
row; they store nothing because their slot is -1.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import torch

from engine.forward_context import AttentionMetadata, forward_context
from engine.layers.attention import Attention, attention_layers
from engine.worker.graph_inputs import copy_step_in, static_token_buffers


def capture_sizes(max_tokens: int) -> list[int]:
    """Token-count buckets: steps of 16 up to 512, of 64 above (a step of n > 512 tokens
    pads by at most n / 8)."""
    sizes = list(range(16, min(max_tokens, 512) + 1, 16)) + list(range(576, max_tokens + 1, 64))
    return sorted(set(sizes) | {max_tokens})


class PiecewiseCudaGraphs:
    def __init__(self, model: torch.nn.Module, max_tokens: int, dtype: torch.dtype | None = None):
        """`model` with its KV caches bound: their block size and device are the graphs'.
        dtype: the activations' (None: the caches', which an fp8 cache cannot give)."""
        layers = attention_layers(model)
        shapes = {(layer.num_heads, layer.head_dim) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"piecewise CUDA graphs need one attention shape, got {shapes}")
        num_heads, head_dim = shapes.pop()
        cache = layers[0].kv_cache
        if cache is None:
            raise RuntimeError("bind the KV caches before building piecewise CUDA graphs")
        if dtype is None:
            if cache.dtype == torch.float8_e4m3fn:
                raise ValueError("an fp8 KV cache's piecewise CUDA graphs need the model dtype")
            dtype = cache.dtype
        device = cache.device
        self.model = model
        self.block_size = cache.shape[2]
        self.sizes = capture_sizes(max_tokens)
        n = self.sizes[-1]
        self.input_ids, self.positions, self.slot_mapping = static_token_buffers(n, device)
        self.output = torch.zeros(n, model.config.hidden_size, dtype=dtype, device=device)
        # Every layer's attention reads and writes the same two buffers: layer i is done
        # with them before layer i + 1's graph writes its query.
        self.query = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros_like(self.query)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        """Per bucket: graph 0, then one graph after each attention call. Before `capture`
        (and on a CPU) `run` runs the same pieces eagerly through the same buffers."""
        self.attention_calls: dict[int, list[Attention]] = {}
        """Per bucket: the attention layers in the order the forward called them."""

    def _warmup_meta(self, size: int) -> AttentionMetadata:
        """One request of `size` new tokens over the null block, storing nothing."""
        device = self.input_ids.device
        width = -(-size // self.block_size)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, width, dtype=torch.int32, device=device),
            max_query_len=size,
            max_seq_len=size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        gc.collect()
        # Largest first: the pool then holds enough for every smaller bucket.
        for size in reversed(self.sizes):
            meta = self._warmup_meta(size)
            with forward_context(meta):
                self.model(self.input_ids[:size], self.positions[:size])  # compiles, autotunes
            torch.cuda.synchronize()
            self._capture(size, meta, pool, stream)
        torch.cuda.synchronize()

    def _capture(self, size: int, meta: AttentionMetadata, pool, stream: torch.cuda.Stream) -> None:
        pieces: list[torch.cuda.CUDAGraph] = []
        calls: list[Attention] = []
        graph = torch.cuda.CUDAGraph()

        def split(layer: Attention, query: torch.Tensor) -> torch.Tensor:
            nonlocal graph
            self.query[:size].copy_(query)
            graph.capture_end()
            pieces.append(graph)
            calls.append(layer)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            return self.attn_out[:size]

        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            with forward_context(meta, split):
                hidden = self.model(self.input_ids[:size], self.positions[:size])
            self.output[:size].copy_(hidden)
            graph.capture_end()
        pieces.append(graph)
        self.pieces[size] = pieces
        self.attention_calls[size] = calls

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n, size = copy_step_in(self, input_ids, positions, meta)
        pieces = self.pieces.get(size)
        if pieces is None:
            self._run_eagerly(size, meta)
            return self.output[:n]
        query, out = self.query[:size], self.attn_out[:size]
        for graph, layer in zip(pieces, self.attention_calls[size]):
            graph.replay()
            layer.attend(query, meta, out=out)
        pieces[-1].replay()
        return self.output[:n]

    def _run_eagerly(self, size: int, meta: AttentionMetadata) -> None:
        """What the replay does, without graphs: the whole bucket through the model, each
        attention on the shared buffers with the step's own metadata."""
        query, out = self.query[:size], self.attn_out[:size]

        def split(layer: Attention, q: torch.Tensor) -> torch.Tensor:
            query.copy_(q)
            return layer.attend(query, meta, out=out)

        padded = replace(meta, slot_mapping=self.slot_mapping[:size])
        with forward_context(padded, split):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
        self.output[:size].copy_(hidden)
