"""Engine configuration: vLLM-named arguments, resolved "auto" values and batch defaults."""

from __future__ import annotations

import pickle

import pytest

import engine.config
from engine.config import (
    SERVER_PREFILL_TOKENS_WITH_DECODES,
    EngineConfig,
    default_batch_limits,
    max_default_num_seqs,
)
from engine.executor import Executor, UniProcExecutor, get_executor_class

GIB = 2**30


@pytest.mark.parametrize(
    ("gpu", "usage", "want"),
    [
        ((141 * GIB, "NVIDIA H200"), "offline", (1024, 16384)),
        ((141 * GIB, "NVIDIA H200"), "server", (1024, 8192)),
        ((80 * GIB, "NVIDIA H100 80GB HBM3"), "offline", (1024, 16384)),
        # vLLM measured the large budgets to lose throughput on an A100.
        ((80 * GIB, "NVIDIA A100-SXM4-80GB"), "offline", (256, 8192)),
        ((24 * GIB, "NVIDIA L4"), "offline", (256, 8192)),
        (None, "offline", (256, 8192)),
    ],
)
def test_batch_defaults_follow_vllms_for_the_gpu(gpu, usage, want):
    assert default_batch_limits(gpu, usage) == want


def test_a_bound_set_before_the_gpu_is_known_takes_the_largest_default():
    # A Serve replica's max_ongoing_requests: the deployment is built before its GPU is seen.
    assert max_default_num_seqs("cuda") == default_batch_limits((141 * GIB, "H200"), "server")[0]
    assert max_default_num_seqs("cpu") == max_default_num_seqs(None) == 256


def test_create_resolves_batch_defaults_for_the_device_and_keeps_given_values(monkeypatch):
    cpu = EngineConfig.create(device="cpu")
    assert (cpu.scheduler_config.max_num_seqs, cpu.scheduler_config.max_num_batched_tokens) == (
        256,
        8192,
    )
    assert cpu.model.dtype == "float32"
    monkeypatch.setattr(engine.config, "_gpu_memory_and_name", lambda device: (141 * GIB, "H200"))
    offline = EngineConfig.create(device="cuda").scheduler_config
    server = EngineConfig.create(device="cuda", usage_context="server").scheduler_config
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == (1024, 16384)
    assert (server.max_num_seqs, server.max_num_batched_tokens) == (1024, 8192)
    given = EngineConfig.create(device="cuda", max_num_seqs=64).scheduler_config
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (64, 16384)


def test_a_server_keeps_prompts_beside_decodes_short_and_offline_does_not():
    def cap(**args):
        return EngineConfig.create(
            device="cpu", **args
        ).scheduler_config.max_prefill_tokens_with_decodes

    assert cap(usage_context="server") == SERVER_PREFILL_TOKENS_WITH_DECODES
    assert cap() == 0
    assert cap(usage_context="server", max_prefill_tokens_with_decodes=0) == 0
    assert cap(max_prefill_tokens_with_decodes=256) == 256
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        cap(max_prefill_tokens_with_decodes=-1)


def test_unknown_engine_argument_is_named():
    with pytest.raises(ValueError, match="unknown engine argument.*max_num_seq\\b"):
        EngineConfig.create(device="cpu", max_num_seq=8)


class _GroupExecutor(Executor):
    """An executor of several ranks from outside the engine (its methods are never run)."""


def test_several_ranks_run_on_a_registered_backend_or_a_class_from_outside_the_engine():
    from cluster.executor import RayActorGroupExecutor

    assert get_executor_class(EngineConfig.create(device="cpu")) is UniProcExecutor
    # None picks the registered "ray" backend for several ranks (pyproject's entry point),
    # as LLM(model, tensor_parallel_size=4) offline expects; naming it does the same.
    for backend in (None, "ray"):
        config = EngineConfig.create(
            device="cpu", tensor_parallel_size=2, distributed_executor_backend=backend
        )
        assert get_executor_class(config) is RayActorGroupExecutor
    one_rank = EngineConfig.create(
        device="cpu", tensor_parallel_size=2, distributed_executor_backend="uni"
    )
    with pytest.raises(ValueError, match="= 2 ranks .* as distributed_executor_backend"):
        get_executor_class(one_rank)
    unknown = EngineConfig.create(device="cpu", distributed_executor_backend="mpi")
    with pytest.raises(ValueError, match="'mpi' is not an installed executor backend"):
        get_executor_class(unknown)
    group = EngineConfig.create(
        device="cpu", pipeline_parallel_size=2, distributed_executor_backend=_GroupExecutor
    )
    assert get_executor_class(group) is _GroupExecutor
    # An engine process gets its arguments pickled: the class travels by reference.
    assert pickle.loads(pickle.dumps(group)) == group
    other = EngineConfig.create(device="cpu", distributed_executor_backend=dict)
    with pytest.raises(ValueError, match="distributed_executor_backend=dict is not a subclass"):
        get_executor_class(other)
