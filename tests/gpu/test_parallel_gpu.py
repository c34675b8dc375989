"""On two GPUs through Ray (NCCL, the compiled-graph step): PP=2 and TP=2 give TP=1's
greedy tokens. Run on the device: `pytest -m gpu tests/gpu/test_parallel_gpu.py`."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from cluster.executor import RayActorGroupExecutor
from cluster.topology import free_port
from engine import LLM, SamplingParams
from engine.config import world_size
from tests.support.tiny_models import write_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

PROMPTS = [[5, 17, 99, 3, 200, 41], [250, 7, 7, 12], list(range(10, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _tokens(path: str, **engine_args) -> list[list[int]]:
    ranks = world_size(
        engine_args.get("tensor_parallel_size"), engine_args.get("pipeline_parallel_size")
    )
    if ranks > 1:
        engine_args["distributed_executor_backend"] = RayActorGroupExecutor
    llm = LLM(path, max_model_len=128, gpu_memory_utilization=0.3, **engine_args)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pp2_equals_tp1(tiny, dtype):
    assert _tokens(tiny, dtype=dtype, pipeline_parallel_size=2) == _tokens(tiny, dtype=dtype)


def test_tp2_equals_tp1_in_float32(tiny):
    # float32: bf16 all-reduce sums in another order and may flip a near-tie.
    want = _tokens(tiny, dtype="float32")
    assert _tokens(tiny, dtype="float32", tensor_parallel_size=2) == want


def test_tp2_sequence_parallel_equals_tp1_in_float32(tiny):
    # Every step sequence-parallel through torch's fused all-gather / reduce-scatter GEMMs.
    want = _tokens(tiny, dtype="float32")
    got = _tokens(tiny, dtype="float32", tensor_parallel_size=2, sequence_parallel_min_tokens=1)
    assert got == want


def test_tp2_piecewise_graphs_equal_tp1_in_float32(tiny):
    # Prefill steps (the 50-token prompt in chunks of 16) replay graphs whose all-reduces
    # run on both ranks between eager attention calls.
    want = _tokens(tiny, dtype="float32")
    got = _tokens(
        tiny,
        dtype="float32",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        prefill_cuda_graph_tokens=16,
    )
    assert got == want


def _peer_all_reduce_rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    from engine import distributed as kd

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    kd.init_distributed(2, 1, rank, backend="nccl", init_method=f"tcp://127.0.0.1:{port}")
    try:
        assert kd.init_symmetric_all_reduce(device, max_bytes=1 << 20)
        for dtype in (torch.bfloat16, torch.float32):
            for numel in (8, 4096, 4096 * 7 + 8, (1 << 20) // dtype.itemsize):
                torch.manual_seed(1000 * rank + numel)
                x = torch.randn(numel, dtype=dtype, device=device)
                want = x.clone()
                dist.all_reduce(want, group=kd.get_tp_group())
                assert kd.get_symmetric_all_reduce().fits(x)
                got = kd.tensor_model_parallel_all_reduce(x.clone())
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        # Captured in a CUDA graph and replayed on new data, as decode steps run.
        x = torch.empty(4096, dtype=torch.bfloat16, device=device)
        kd.tensor_model_parallel_all_reduce(x.clone())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = kd.tensor_model_parallel_all_reduce(x)
        for step in range(3):
            x.copy_(torch.full_like(x, rank + step))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, torch.full_like(x, 1 + 2 * step))
        # Too large or float16: NCCL, same sums.
        big = torch.ones((1 << 20) // 2 + 8, dtype=torch.bfloat16, device=device)
        assert not kd.get_symmetric_all_reduce().fits(big)
        assert torch.equal(kd.tensor_model_parallel_all_reduce(big), torch.full_like(big, 2))
    finally:
        kd.destroy_distributed()


def test_peer_memory_all_reduce_equals_nccl():
    mp.start_processes(_peer_all_reduce_rank, args=(free_port(),), nprocs=2, start_method="spawn")


def test_tp2_weights_switch_sleep_and_wake_on_both_gpus(tiny, tmp_path):
    """The model lifecycle on both ranks beside the compiled graph's loop: weights copied in
    place under captured CUDA graphs, then sleep and a wake-up that captures them again (on
    each rank's control thread, while the graph's loop idles)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((Path(tiny) / "config.json").read_text())
    tensors = load_file(Path(tiny) / "model.safetensors")
    save_file(
        {k: v * 1.5 if v.dim() == 2 else v for k, v in tensors.items()}, other / "model.safetensors"
    )
    want, want_other = _tokens(tiny, dtype="float32"), _tokens(str(other), dtype="float32")
    llm = LLM(
        tiny,
        max_model_len=128,
        gpu_memory_utilization=0.3,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend=RayActorGroupExecutor,
        weight_cache_gb=1,
    )
    try:
        llm.load_model(str(other), weights_only=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want_other
        llm.load_model(tiny, weights_only=True)
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.engine.shutdown()
