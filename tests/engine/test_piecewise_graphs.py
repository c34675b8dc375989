"""Steps with prefills through the piecewise-graph path (engine/worker/piecewise_graphs.py).

On a CPU the path runs its pieces eagerly: the same static buffers, bucket padding and
attention on the step's own metadata that a GPU replays between its graphs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.forward_context import AttentionMetadata, forward_context, get_attention_split
from engine.layers.attention import attention_layers
from engine.worker.piecewise_graphs import PiecewiseCudaGraphs, capture_sizes
from tests.support.prompts import PROMPTS

TOKEN_BUDGET = 64


def _llm() -> LLM:
    # A small token budget: prompts prefill in chunks beside running decodes.
    return LLM(max_model_len=1024, max_num_batched_tokens=TOKEN_BUDGET, max_num_seqs=8)


def test_steps_padded_to_a_bucket_give_the_tokens_of_unpadded_steps():
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = _llm()
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]

    llm = _llm()
    runner = llm.engine.executor.worker.runner
    graphs = PiecewiseCudaGraphs(runner.model, max_tokens=TOKEN_BUDGET)
    steps = []
    run = graphs.run

    def spy(input_ids, positions, meta):
        steps.append((input_ids.shape[0], meta.max_query_len, meta.num_decodes))
        return run(input_ids, positions, meta)

    graphs.run = spy
    runner.piecewise_graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    assert got == expected
    assert any(n not in graphs.sizes for n, _, _ in steps), "no step was padded"
    assert any(q > 1 and d > 0 for _, q, d in steps), "no step mixed decodes and a prefill"
    for ours, theirs in zip(runner.kv_caches, plain.engine.executor.worker.runner.kv_caches):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)


def test_rows_past_the_step_store_nothing_and_leave_its_rows_alone():
    runner = _llm().engine.executor.worker.runner
    graphs = PiecewiseCudaGraphs(runner.model, max_tokens=TOKEN_BUDGET)
    for cache in runner.kv_caches:
        cache.zero_()
    n, bs = 5, runner.block_size
    # Leftovers of an earlier, larger step in the bucket's other rows: tokens, and slots
    # in block 2, which this step's request does not own.
    size = min(s for s in graphs.sizes if s > n)
    gen = torch.Generator().manual_seed(0)
    graphs.input_ids[:size] = torch.randint(0, 1000, (size,), generator=gen)
    graphs.positions[:size] = torch.arange(size)
    graphs.slot_mapping[:size] = 2 * bs + torch.arange(size) % bs
    input_ids = torch.randint(0, 1000, (n,), generator=gen)
    positions = torch.arange(n)
    meta = AttentionMetadata(
        slot_mapping=bs + torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.inference_mode():
        hidden = graphs.run(input_ids, positions, meta).clone()
        stored = [cache[:, 1].clone() for cache in runner.kv_caches]
        for cache in runner.kv_caches:
            assert not cache[:, 2].any(), "a padding row stored into block 2"
            assert cache[:, 1, :n].abs().sum() > 0
            cache.zero_()
        with forward_context(meta):
            expected = runner.model(input_ids, positions)
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-5)
    for cache, before in zip(runner.kv_caches, stored):
        torch.testing.assert_close(cache[:, 1], before, rtol=1e-4, atol=1e-5)


def test_capture_sizes_bound_the_padding():
    sizes = capture_sizes(2048)
    assert sizes[0] == 16 and sizes[-1] == 2048
    for n in range(1, 2049):
        bucket = min(s for s in sizes if s >= n)
        assert bucket - n < 64 and (n < 512 or bucket <= n * 1.125)
    assert capture_sizes(100)[-1] == 100


def test_prefill_cuda_graph_tokens_is_checked():
    with pytest.raises(ValueError, match="prefill_cuda_graph_tokens"):
        EngineConfig.create(device="cpu", prefill_cuda_graph_tokens=-1)
    config = EngineConfig.create(device="cpu", prefill_cuda_graph_tokens=512)
    assert config.prefill_cuda_graph_tokens == 512
    assert EngineConfig.create(device="cpu").prefill_cuda_graph_tokens == 2048
    # Across tensor-parallel ranks only when asked for.
    assert EngineConfig.create(device="cpu", tensor_parallel_size=3).prefill_cuda_graph_tokens == 0
    tp = EngineConfig.create(device="cpu", tensor_parallel_size=3, prefill_cuda_graph_tokens=64)
    assert tp.prefill_cuda_graph_tokens == 64


class _RecordingGraph:
    """Stands in for torch.cuda.CUDAGraph on a CPU: records the capture calls and replays."""

    log: list = []

    def capture_begin(self, pool=None):
        assert pool is not None, "every piece must share the pool"
        _RecordingGraph.log.append(("begin", self))

    def capture_end(self):
        assert _RecordingGraph.log[-1][0] != "end", "a capture ended twice"
        _RecordingGraph.log.append(("end", self))

    def replay(self):
        _RecordingGraph.log.append(("replay", self))


def test_capture_splits_at_every_attention_and_replay_interleaves_them(monkeypatch):
    """The capture and replay control flow, with CUDA's graph calls recorded on a CPU."""
    runner = _llm().engine.executor.worker.runner
    graphs = PiecewiseCudaGraphs(runner.model, max_tokens=32)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordingGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    _RecordingGraph.log = []
    graphs.capture()

    layers = attention_layers(runner.model)
    assert sorted(graphs.pieces) == graphs.sizes == [16, 32]
    for size in graphs.sizes:
        assert graphs.attention_calls[size] == layers
        assert len(graphs.pieces[size]) == len(layers) + 1
    kinds = [kind for kind, _ in _RecordingGraph.log]
    assert kinds == ["begin", "end"] * (len(layers) + 1) * len(graphs.sizes)
    assert get_attention_split() is None

    _RecordingGraph.log = []
    attended = []

    def logging_attend(layer, attend):
        def wrapped(q, meta, out=None):
            attended.append((q.shape[0], out is not None))
            _RecordingGraph.log.append(("attend", layer))
            return attend(q, meta, out=out)

        return wrapped

    for layer in layers:
        monkeypatch.setattr(layer, "attend", logging_attend(layer, layer.attend))
    n = 20
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n) + runner.block_size,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.inference_mode():
        graphs.run(torch.randint(0, 1000, (n,)), torch.arange(n), meta)
    pieces = graphs.pieces[32]
    expected = [("replay", pieces[0])]
    for layer, piece in zip(layers, pieces[1:]):
        expected += [("attend", layer), ("replay", piece)]
    assert _RecordingGraph.log == expected
    assert attended == [(32, True)] * len(layers)
    assert (graphs.slot_mapping[n:32] == -1).all()
