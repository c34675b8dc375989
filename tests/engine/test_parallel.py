"""Tensor- and pipeline-parallel actor groups through Ray (gloo on CPU) give TP=1's greedy
tokens; dead workers fail a step promptly; shutdown leaves no process or placement behind.

All modules of a test process share one local Ray instance (tests/support/serve_apps.py).
"""

from __future__ import annotations

import functools
import gc
import time

import psutil
import pytest
import ray
import torch

from cluster.executor import RayActorGroupExecutor, WorkerDiedError
from engine import LLM, SamplingParams
from engine.config import EngineConfig, ParallelConfig
from engine.llm_engine import LLMEngine
from engine.worker.loader import load_hf_config, resolve_model_source
from tests.support.serve_apps import start_ray
from tests.support.steps_in_flight import record_steps_in_flight
from tests.support.tiny_models import TINY_ARGS, write_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TOKEN_PROMPTS = [[5, 17, 99, 3, 200, 41], [250, 7, 7, 12]]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# A small KV cache per rank: six ranks of the default 1 GiB would take 6 GiB of memory.
SMOL_ARGS = dict(max_model_len=256, cpu_kv_cache_gib=0.05)
# The engine starts no workers of its own: a group of ranks needs the actor group's class.
RAY_GROUP = dict(distributed_executor_backend=RayActorGroupExecutor)


@pytest.fixture(scope="module")
def ray_instance():
    start_ray()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint folder, TP=1 greedy tokens, TP=1 weight bytes)."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    llm = LLM(path, **TINY_ARGS)
    return path, _tokens(llm, TOKEN_PROMPTS), llm.engine.executor.step_weight_bytes()


@pytest.fixture(scope="module")
def smollm2():
    """(TP=1 engine, its greedy tokens) of the bundled SmolLM2."""
    llm = LLM(**SMOL_ARGS)
    return llm.engine, _tokens(llm, TEXT_PROMPTS)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _engine_tokens(engine: LLMEngine, prompts) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    done = {}
    while len(done) < len(prompts):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def _engine(model: str, use_compiled_graph: bool | None = None, **engine_args) -> LLMEngine:
    source = resolve_model_source(model)
    hf_config = load_hf_config(source)
    config = EngineConfig.create(hf_config=hf_config, model=model, **engine_args)
    executor = functools.partial(RayActorGroupExecutor, use_compiled_graph=use_compiled_graph)
    return LLMEngine(config, hf_config, source, None, executor_class=executor)


def _assert_gone(pids: list[int], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p)]


@pytest.mark.parametrize(
    ("tp", "pp", "sequence_parallel_min_tokens"),
    [(3, 1, None), (1, 2, None), (3, 2, 3)],
    # TP x PP without sequence parallel: the tiny Llama's tp2 x pp2 and tp4 x pp2 below.
    ids=["tp3", "pp2", "tp3xpp2-sequence-parallel-prefills"],
)
def test_smollm2_parallel_greedy_equals_tp1(
    ray_instance, smollm2, tp, pp, sequence_parallel_min_tokens
):
    # Sequence parallel from 3 tokens: the prefills (5 and 6 tokens: rows padded to a
    # multiple of 3) run with the residual stream split by rows across the TP ranks and
    # handed between the stages whole; the decodes of one or two tokens all-reduce.
    llm = LLM(
        **SMOL_ARGS,
        **RAY_GROUP,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        sequence_parallel_min_tokens=sequence_parallel_min_tokens,
    )
    try:
        # The ranks serve until they exit: their start-up heaps are out of the collector's
        # reach (engine/observability/gc_pauses.py), so no full collection stalls the group's steps.
        workers = llm.engine.executor.workers
        frozen = ray.get([w.__ray_call__.remote(lambda _: gc.get_freeze_count()) for w in workers])
        assert min(frozen) > 10_000, frozen
        in_flight = record_steps_in_flight(llm.engine)
        assert _tokens(llm, TEXT_PROMPTS) == smollm2[1]
        # Tensor-parallel ranks overlap step t+1 with step t (each feeds its decodes the
        # driver's broadcast samples); pipeline stages each hold a batch.
        assert max(in_flight) == 1
    finally:
        llm.engine.shutdown()


def test_smollm2_tp2_is_refused_before_any_worker_starts(ray_instance, smollm2):
    reference = smollm2[0]
    config = reference.config.model_copy(
        update={"parallel_config": ParallelConfig(tensor_parallel_size=2, **RAY_GROUP)}
    )
    placed_before = len(ray.util.placement_group_table())
    # 9 query heads and 3 KV heads cannot be split in two.
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible by tensor_par"):
        LLMEngine(config, reference.hf_config, reference.executor.source, reference.tokenizer)
    assert len(ray.util.placement_group_table()) == placed_before


def test_tiny_llama_tp2_pp2_equals_tp1_with_a_batch_in_each_stage(ray_instance, tiny):
    path, want, whole_bytes = tiny
    # Two stages: the engine keeps two steps in flight, each with one of the two requests,
    # so while one request's batch is in the second stage the other's runs in the first.
    llm = LLM(
        path,
        **TINY_ARGS,
        **RAY_GROUP,
        max_num_batched_tokens=6,  # prompts are prefilled in chunks, in flight too
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    )
    try:
        in_flight = record_steps_in_flight(llm.engine)
        assert _tokens(llm, TOKEN_PROMPTS) == want
        assert max(in_flight) == 1  # one step unread when the next is launched
        # Nearly every step is launched while the other request's step is in flight.
        assert sum(in_flight) >= 0.8 * len(in_flight), in_flight
        # A decode step streams one TP shard per stage: half the weights, plus the norms
        # (replicated on every rank) counted twice.
        norm_bytes = (2 * 4 + 1) * 64 * 4
        assert llm.engine.executor.step_weight_bytes() == pytest.approx(
            whole_bytes / 2 + norm_bytes / 2, abs=norm_bytes
        )
    finally:
        llm.engine.shutdown()


def test_prompt_logprobs_of_tp2_pp2_equal_tp1(ray_instance, tiny):
    # The last stage's ranks all join the LM head's gather for the prompt rows; the driver
    # reports them, computed over several chunks of each prompt.
    path = tiny[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    want = LLM(path, **TINY_ARGS).generate(TOKEN_PROMPTS, params)
    llm = LLM(
        path,
        **TINY_ARGS,
        **RAY_GROUP,
        max_num_batched_tokens=4,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    )
    try:
        got = llm.generate(TOKEN_PROMPTS, params)
    finally:
        llm.engine.shutdown()
    for g, w in zip(got, want, strict=True):
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(w.prompt_token_ids)
        assert g.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert (a.token_id, a.rank, list(a.top)) == (b.token_id, b.rank, list(b.top))
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_dummy_weights_are_the_same_for_every_layout(ray_instance):
    # Benchmarks compare layouts on dummy weights: TP=2 x PP=2 must hold TP=1's weights.
    args = dict(model="tiny-llama", load_format="dummy", **TINY_ARGS)
    want = _tokens(LLM(**args), TOKEN_PROMPTS)
    llm = LLM(**args, **RAY_GROUP, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        assert _tokens(llm, TOKEN_PROMPTS) == want
    finally:
        llm.engine.shutdown()


def test_tiny_llama_tp4_pp2_equals_tp1_and_shutdown_leaves_nothing(ray_instance, tiny):
    path, want, _ = tiny
    free_cpus = ray.available_resources().get("CPU")
    engine = _engine(path, **TINY_ARGS, tensor_parallel_size=4, pipeline_parallel_size=2)
    executor = engine.executor
    assert _engine_tokens(engine, TOKEN_PROMPTS) == want
    pids, group = executor.worker_pids, executor.placement.placement_group
    assert len(set(pids)) == 8
    engine.shutdown()
    _assert_gone(pids)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    assert ray.available_resources().get("CPU") == free_cpus


def test_compiled_graph_tp2_equals_tp1_and_a_killed_worker_fails_the_step(ray_instance, tiny):
    path, want, _ = tiny
    engine = _engine(path, use_compiled_graph=True, **TINY_ARGS, tensor_parallel_size=2)
    executor = engine.executor
    assert executor.use_compiled_graph
    assert _engine_tokens(engine, TOKEN_PROMPTS) == want

    engine.add_request("mid", TOKEN_PROMPTS[0], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(3):
        engine.step()
    executor.check_health()
    pids = executor.worker_pids
    ray.kill(executor.workers[1], no_restart=True)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError):
        while True:
            engine.step()
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerDiedError):
        executor.check_health()
    engine.shutdown()
    _assert_gone(pids)


def test_tp2_pp2_swapping_under_pressure_equals_tp1(ray_instance, tiny):
    """swap_space across an actor group: every rank copies its own shard (both stages, both
    tensor-parallel halves) and the swapped request resumes with the tokens of TP=1."""
    path, want, _ = tiny
    # 7 usable blocks of 4 tokens; the two requests grow to 6 and 5 blocks.
    group = dict(tensor_parallel_size=2, pipeline_parallel_size=2, **RAY_GROUP)
    swap = dict(num_gpu_blocks=8, swap_space=0.001, preemption_mode="swap")
    llm = LLM(path, **(TINY_ARGS | group | swap))
    try:
        assert _tokens(llm, TOKEN_PROMPTS) == want
        stats = llm.engine.stats()
        assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]
        offload = llm.engine.scheduler.offload
        assert not offload.swapped
        assert offload.pool.num_free + len(offload.pool.tier) == offload.pool.num_blocks
    finally:
        llm.engine.shutdown()


def _changed_copy(path: str, folder, **replace) -> str:
    """The checkpoint at `path` with every matrix scaled by 1.5 (other tokens, same shapes),
    and the tensors of `replace` (dots as double underscores) instead of its own."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    folder.mkdir()
    (folder / "config.json").write_text((Path(path) / "config.json").read_text())
    tensors = {
        k: v * 1.5 if v.dim() == 2 else v
        for k, v in load_file(Path(path) / "model.safetensors").items()
    }
    tensors |= {k.replace("__", "."): v for k, v in replace.items()}
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


def test_pp2_load_weights_sleep_and_wake_on_every_rank(ray_instance, tiny, tmp_path):
    """Every rank stages, then commits its part; a mismatch on one stage's rank leaves both
    serving the old weights; sleep and wake run on every rank (tensor-parallel ranks: the
    compiled-graph test below)."""
    path, want, _ = tiny
    other = _changed_copy(path, tmp_path / "other")
    wrong = _changed_copy(
        path, tmp_path / "wrong", model__layers__3__mlp__up_proj__weight=torch.zeros(80, 64)
    )
    reference = LLM(other, **TINY_ARGS)
    want_other = _tokens(reference, TOKEN_PROMPTS)
    reference.engine.shutdown()
    assert want_other != want
    llm = LLM(
        path,
        **TINY_ARGS,
        **RAY_GROUP,
        pipeline_parallel_size=2,
        weight_cache_gb=0.01,
    )
    try:
        llm.load_model(other, weights_only=True)
        assert _tokens(llm, TOKEN_PROMPTS) == want_other
        # Only the second stage holds layer 3: it refuses, and the first stage's staged
        # weights are discarded.
        with pytest.raises(ValueError, match=r"layers.3.mlp.up_proj.weight.*\(80, 64\)"):
            llm.load_model(wrong, weights_only=True)
        assert _tokens(llm, TOKEN_PROMPTS) == want_other
        llm.load_model(path, weights_only=True)  # from every rank's weight cache
        assert _tokens(llm, TOKEN_PROMPTS) == want
        llm.sleep(2)  # level 1 on ranks: the compiled-graph test below
        llm.wake_up()  # from every rank's weight cache
        assert _tokens(llm, TOKEN_PROMPTS) == want
    finally:
        llm.engine.shutdown()


def test_compiled_graph_ranks_load_weights_beside_the_graphs_loop(ray_instance, tiny, tmp_path):
    path, want, _ = tiny
    other = _changed_copy(path, tmp_path / "other")
    engine = _engine(path, use_compiled_graph=True, **TINY_ARGS, tensor_parallel_size=2)
    try:
        assert _engine_tokens(engine, TOKEN_PROMPTS) == want
        engine.load_model(other, weights_only=True)
        engine.load_model(path, weights_only=True)
        engine.sleep(1)
        engine.wake_up()
        assert _engine_tokens(engine, TOKEN_PROMPTS) == want
    finally:
        engine.shutdown()
