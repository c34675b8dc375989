"""The model lifecycle offline (engine/lifecycle.py, engine/worker/weight_lifecycle.py): a
checkpoint's weights loaded in place, a whole switch to a model of another size, the weight
cache, sleep and wake, and failed switches that leave the old model serving."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, SamplingParams
from engine.worker import loader
from engine.worker.weight_cache import process_weight_cache
from tests.support.bundled_checkpoints import PROMPT, bundled_float_weights, write_checkpoint
from tests.support.random_checkpoints import CONFIG, PROMPTS, random_llama_weights, write_llama

GREEDY = SamplingParams(temperature=0, max_tokens=6)
SMALL = dict(max_model_len=128, cpu_kv_cache_gib=0.01, max_num_seqs=4)
logger = logging.getLogger(__name__)


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def perturbed(tensors: dict[str, torch.Tensor], seed: int, scale: float) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v
        for k, v in tensors.items()
    }


def write_wider_llama(folder: Path) -> str:
    """A random Llama of another size than CONFIG's (3 layers, a wider MLP)."""
    fields = CONFIG | {"num_hidden_layers": 3, "intermediate_size": 768}
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(LlamaConfig(**fields)).state_dict()
    gen = torch.Generator().manual_seed(7)
    tensors = {
        name: torch.ones(m.shape) if "norm" in name else torch.randn(m.shape, generator=gen) * 0.05
        for name, m in shapes.items()
    }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(LlamaConfig(**fields).to_json_string())
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


@pytest.fixture(autouse=True)
def empty_weight_cache():
    """The process's weight cache outlives engines: each test starts with it empty."""
    process_weight_cache(0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lifecycle")
    weights = random_llama_weights()
    return {
        "a": write_llama(root / "a", weights),
        "b": write_llama(root / "b", perturbed(weights, 1, 0.5)),
        "wide": write_wider_llama(root / "wide"),
        "root": str(root),
    }


@pytest.fixture(scope="module")
def fresh(checkpoints) -> dict[str, list[list[int]]]:
    """Each checkpoint's greedy tokens from an engine of its own."""
    out = {}
    for name in ("a", "b", "wide"):
        llm = LLM(checkpoints[name], **SMALL)
        out[name] = tokens(llm)
        llm.engine.shutdown()
    assert out["a"] != out["b"] and out["a"] != out["wide"]
    return out


def live_pointers(llm: LLM) -> tuple[list[int], list[int]]:
    runner = llm.engine.executor.worker.runner
    return (
        [p.data_ptr() for p in runner.model.parameters()],
        [c.data_ptr() for c in runner.kv_caches],
    )


def test_weights_only_switch_equals_a_fresh_engine_and_keeps_the_tensors(checkpoints, fresh):
    llm = LLM(checkpoints["a"], **SMALL)
    assert tokens(llm) == fresh["a"]
    before = live_pointers(llm)
    llm.load_model(checkpoints["b"], weights_only=True)
    assert tokens(llm) == fresh["b"]
    assert live_pointers(llm) == before  # copied in place: weights, KV cache
    assert llm.engine.model_name == "b"
    assert llm.engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block == {}


def test_the_bundled_model_switched_in_place_equals_a_fresh_engine(tmp_path):
    _, weights = bundled_float_weights()
    # Cheap on 135M weights: every MLP's output scaled.
    scaled = {k: v * 1.5 if "down_proj" in k else v for k, v in weights.items()}
    folder = write_checkpoint(tmp_path / "perturbed", scaled)
    prompts = [PROMPT]
    llm = LLM(max_model_len=128, cpu_kv_cache_gib=0.02)
    old = tokens(llm, prompts)
    llm.load_model(str(folder), weights_only=True)
    switched = tokens(llm, prompts)
    llm.engine.shutdown()
    assert switched == tokens(LLM(str(folder), max_model_len=128, cpu_kv_cache_gib=0.02), prompts)
    assert switched != old


def test_a_whole_switch_to_another_size_equals_a_fresh_engine(checkpoints, fresh):
    llm = LLM(checkpoints["a"], **SMALL)
    llm.load_model(checkpoints["wide"])
    assert llm.engine.hf_config.num_hidden_layers == 3
    assert tokens(llm) == fresh["wide"]
    assert llm.engine.config.scheduler_config.max_model_len == 128  # the engine keys stay
    llm.load_model(checkpoints["wide"], max_batch_size=2)  # keys given replace them, by any name
    assert llm.engine.config.scheduler_config.max_num_seqs == 2
    assert tokens(llm) == fresh["wide"]
    llm.load_model(checkpoints["a"])
    assert tokens(llm) == fresh["a"]


def test_switching_back_comes_from_the_weight_cache(checkpoints, fresh, monkeypatch):
    llm = LLM(checkpoints["a"], weight_cache_gb=0.1, **SMALL)
    start = time.perf_counter()
    llm.load_model(checkpoints["b"], weights_only=True)
    from_disk = time.perf_counter() - start
    monkeypatch.setattr(loader, "_load_safetensors", _refuse_reads)
    start = time.perf_counter()
    llm.load_model(checkpoints["a"], weights_only=True)
    from_cache = time.perf_counter() - start
    logger.warning(
        "weights-only switch: %.3f s from disk, %.3f s from the cache", from_disk, from_cache
    )
    assert tokens(llm) == fresh["a"]
    llm.load_model(checkpoints["b"], weights_only=True)  # kept when it was read
    assert tokens(llm) == fresh["b"]


def test_a_whole_switch_back_builds_the_model_from_the_weight_cache(
    checkpoints, fresh, monkeypatch
):
    llm = LLM(checkpoints["a"], weight_cache_gb=0.1, **SMALL)
    llm.load_model(checkpoints["wide"])
    monkeypatch.setattr(loader, "_load_safetensors", _refuse_reads)
    llm.load_model(checkpoints["a"])
    assert tokens(llm) == fresh["a"]


def _refuse_reads(model, folder):
    raise AssertionError(f"the checkpoint {folder} was read")


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("weight_cache_gb", [0, 0.1])
def test_sleep_then_wake_gives_the_same_tokens(checkpoints, fresh, level, weight_cache_gb):
    llm = LLM(checkpoints["a"], weight_cache_gb=weight_cache_gb, **SMALL)
    runner = llm.engine.executor.worker.runner
    num_blocks = runner.kv_caches[0].shape[1]
    llm.sleep(level)
    assert llm.is_sleeping()
    assert runner.kv_caches == []
    assert all(p.numel() == 0 for p in runner.model.parameters())
    with pytest.raises(RuntimeError, match=r"asleep \(sleep level \d\): call wake_up\(\)"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert runner.kv_caches[0].shape[1] == num_blocks
    assert tokens(llm) == fresh["a"]


def test_level_2_wakes_from_the_weight_cache_without_reading(checkpoints, fresh, monkeypatch):
    llm = LLM(checkpoints["a"], weight_cache_gb=0.1, **SMALL)
    llm.load_model(checkpoints["b"], weights_only=True)
    llm.load_model(checkpoints["a"], weights_only=True)  # b kept in the cache; a from it
    llm.sleep(2)
    monkeypatch.setattr(loader, "_load_safetensors", _refuse_reads)
    llm.wake_up()
    assert tokens(llm) == fresh["a"]


def test_sleep_and_switch_wait_for_requests_in_flight(checkpoints):
    llm = LLM(checkpoints["a"], **SMALL)
    for i, prompt in enumerate(PROMPTS[:2]):
        llm.engine.add_request(str(i), prompt, GREEDY)
    with pytest.raises(ValueError, match="2 request"):
        llm.engine.sleep(1)
    with pytest.raises(ValueError, match="2 request"):
        llm.engine.load_model(checkpoints["b"], weights_only=True)
    llm.engine.abort_request(["0", "1"])
    llm.sleep(1)
    llm.wake_up()


def _with_tensor(folder: Path, source: str, name: str, tensor: torch.Tensor) -> str:
    from safetensors.torch import load_file

    tensors = load_file(Path(source) / "model.safetensors") | {name: tensor}
    folder.mkdir()
    (folder / "config.json").write_text((Path(source) / "config.json").read_text())
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


def test_failed_switches_leave_the_old_model_serving(checkpoints, fresh, tmp_path):
    llm = LLM(checkpoints["a"], **SMALL)
    up = "model.layers.1.mlp.up_proj.weight"
    wrong_shape = _with_tensor(tmp_path / "shape", checkpoints["b"], up, torch.zeros(500, 256))
    with pytest.raises(ValueError, match=rf"{up}.*\(500, 256\).*\(512, 256\)"):
        llm.load_model(wrong_shape, weights_only=True)
    assert tokens(llm) == fresh["a"]

    with pytest.raises(FileNotFoundError, match="nowhere"):
        llm.load_model(str(tmp_path / "nowhere"), weights_only=True)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((Path(checkpoints["a"]) / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        llm.load_model(str(no_weights), weights_only=True)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        llm.load_model(str(no_weights))  # refused before anything is torn down
    assert tokens(llm) == fresh["a"]

    corrupt = _with_tensor(tmp_path / "corrupt", checkpoints["b"], up, torch.zeros(512, 256))
    data = (Path(corrupt) / "model.safetensors").read_bytes()
    (Path(corrupt) / "model.safetensors").write_bytes(data[: len(data) // 2])
    for weights_only in (True, False):
        with pytest.raises(Exception, match="(?i)safetensor|incomplete|invalid|metadata"):
            llm.load_model(corrupt, weights_only=weights_only)
        assert tokens(llm) == fresh["a"]
    assert llm.engine.model_name == "a"


def test_weights_only_refuses_other_engine_keys(checkpoints):
    llm = LLM(checkpoints["a"], **SMALL)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.load_model(checkpoints["b"], weights_only=True, max_model_len=64)


def test_reset_prefix_cache_forgets_cached_blocks(checkpoints):
    llm = LLM(checkpoints["a"], **SMALL)
    llm.generate([PROMPTS[0] * 4], GREEDY)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.cached_block_hash_to_block
    assert llm.reset_prefix_cache()
    assert not pool.cached_block_hash_to_block


def test_weight_cache_gb_is_a_serve_key_and_a_flag():
    from cluster.app_config import load_app_config
    from cluster.cli import parse_serve_args
    from cluster.engine_host import engine_args

    config, _ = parse_serve_args(["serve", "--weight-cache-gb", "8"])
    assert engine_args(config).weight_cache_gb == 8.0
    assert engine_args(load_app_config({})).weight_cache_gb == 0
    with pytest.raises(ValueError, match="weight_cache_gb"):
        load_app_config({"weight_cache_gb": -1})


class _LabelSink:
    def __init__(self):
        self.models: list[str] = []

    def inc(self, name, value, labels):
        self.models.append(labels["model"])

    set = observe = inc


@pytest.mark.parametrize("weights_only", [True, False])
def test_metrics_after_a_switch_carry_the_new_models_name(checkpoints, weights_only):
    llm = LLM(checkpoints["a"], **SMALL)
    sink = _LabelSink()
    llm.engine.enable_metrics(sink, flush_interval_s=0)
    llm.generate(PROMPTS[:1], GREEDY)
    llm.load_model(checkpoints["b"], weights_only=weights_only)
    assert set(sink.models) == {"a"}
    sink.models.clear()
    llm.generate(PROMPTS[:1], GREEDY)
    assert sink.models and set(sink.models) == {"b"}
