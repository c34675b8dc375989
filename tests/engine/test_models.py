"""Llama-family models against transformers: one-shot prefill, chunked prefill + decode
through the paged KV cache, ragged batches, tensor and pipeline parallel shards, rope."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from engine.distributed import destroy_distributed, init_distributed, override_parallel_state
from engine.forward_context import AttentionMetadata, forward_context
from engine.layers.attention import attention_layers, bind_kv_caches
from engine.layers.rotary import compute_inv_freq, get_rope, rope_config
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import PLUGIN_ENV, architectures_of, get_model_class

VOCAB = 256
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _configs() -> dict:
    return {
        "llama": LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]),
        "llama3-rope": LlamaConfig(
            **SMALL, rope_parameters=dict(LLAMA3_ROPE), architectures=["LlamaForCausalLM"]
        ),
        "llama-bias-tied": LlamaConfig(
            **{**SMALL, "tie_word_embeddings": True},
            attention_bias=True,
            mlp_bias=True,
            architectures=["LlamaForCausalLM"],
        ),
        "qwen2": Qwen2Config(**SMALL, architectures=["Qwen2ForCausalLM"]),
        "qwen3": Qwen3Config(
            **{**SMALL, "tie_word_embeddings": True},
            head_dim=32,  # not hidden_size / heads: must come from the config
            architectures=["Qwen3ForCausalLM"],
        ),
        "mistral": MistralConfig(**SMALL, sliding_window=128, architectures=["MistralForCausalLM"]),
    }


ARCHS = list(_configs())


def _random_hf_model(config, seed: int = 0):
    """A transformers model with every weight random, norms around 1 (nothing left at init)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def _kvray_model(config, state_dict) -> LlamaForCausalLM:
    model = get_model_class(architectures_of(config))(config)
    loaded = model.load_weights(state_dict.items())
    assert loaded == {name for name, _ in model.named_parameters()}
    return model.eval()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    config = _configs()[request.param]
    hf = _random_hf_model(config)
    return config, hf, _kvray_model(config, hf.state_dict())


def hf_logits(hf, ids: list[int], position_offset: int = 0) -> torch.Tensor:
    with torch.no_grad():
        positions = torch.arange(position_offset, position_offset + len(ids))[None]
        return hf(torch.tensor([ids]), position_ids=positions).logits[0]


class PagedCache:
    """Binds a paged KV cache to a model and runs steps of {seq_id: new token ids} through it,
    giving each sequence blocks in scrambled order so paging is really exercised."""

    def __init__(self, model, num_blocks: int = 48, block_size: int = 4, seed: int = 0):
        self.model = model
        self.block_size = block_size
        weight = next(model.parameters())
        self.device = weight.device
        self.caches = [
            torch.zeros(
                2,
                num_blocks,
                block_size,
                layer.num_kv_heads,
                layer.head_dim,
                dtype=weight.dtype,
                device=self.device,
            )
            for layer in attention_layers(model)
        ]
        bind_kv_caches(model, self.caches)
        g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def meta(self, step: dict[str, list[int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        slots, positions, starts, seq_lens = [], [], [0], []
        for sid, ids in step.items():
            start = self.lens.get(sid, 0)
            end = start + len(ids)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            positions += range(start, end)
            starts.append(starts[-1] + len(ids))
            seq_lens.append(end)
            self.lens[sid] = end
        width = max(len(self.tables[sid]) for sid in step)
        tables = [self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid in step]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(len(ids) for ids in step.values()),
            max_seq_len=max(seq_lens),
        )
        return meta, torch.tensor(positions, dtype=torch.long, device=dev)

    def step(self, step: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        meta, positions = self.meta(step)
        input_ids = torch.tensor(
            [t for ids in step.values() for t in ids], dtype=torch.long, device=self.device
        )
        with torch.no_grad(), forward_context(meta):
            logits = self.model.compute_logits(self.model(input_ids, positions))
        out, offset = {}, 0
        logits = logits.cpu()
        for sid, ids in step.items():
            out[sid] = logits[offset : offset + len(ids)]
            offset += len(ids)
        return out


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_prefill_matches_transformers(pair):
    _, hf, model = pair
    ids = _prompt(13, seed=1)
    logits = PagedCache(model).step({"a": ids})["a"]
    assert logits.dtype == torch.float32 and logits.shape == (13, VOCAB)
    _close(logits, hf_logits(hf, ids))


def test_chunked_prefill_then_decode_matches_transformers(pair):
    _, hf, model = pair
    ids = _prompt(12, seed=2)
    expected = hf_logits(hf, ids)
    cache = PagedCache(model, seed=3)
    got = [cache.step({"a": ids[:5]})["a"], cache.step({"a": ids[5:9]})["a"]]
    got += [cache.step({"a": [t]})["a"] for t in ids[9:]]
    _close(torch.cat(got), expected)


def test_ragged_batch_mixing_prefill_and_decode_matches_transformers(pair):
    _, hf, model = pair
    a, b, c = _prompt(8, seed=4), _prompt(6, seed=5), _prompt(5, seed=6)
    cache = PagedCache(model, seed=7)
    first = cache.step({"a": a[:7], "b": b[:3]})
    second = cache.step({"a": a[7:], "b": b[3:], "c": c})
    _close(torch.cat([first["a"], second["a"]]), hf_logits(hf, a))
    _close(torch.cat([first["b"], second["b"]]), hf_logits(hf, b))
    _close(second["c"], hf_logits(hf, c))


def test_forward_without_kv_cache_matches_transformers(pair):
    """The profiling path: no cache bound, whole prompts attend among themselves."""
    _, hf, model = pair
    a, b = _prompt(9, seed=8), _prompt(4, seed=9)
    cache = PagedCache(model)
    bind_kv_caches(model, [None] * len(cache.caches))
    out = cache.step({"a": a, "b": b})
    _close(out["a"], hf_logits(hf, a))
    _close(out["b"], hf_logits(hf, b))


def test_pipeline_stages_chained_match_transformers():
    config = LlamaConfig(**{**SMALL, "num_hidden_layers": 3, "tie_word_embeddings": True})
    hf = _random_hf_model(config, seed=1)
    stages = []
    for rank in range(2):
        with override_parallel_state(pp_rank=rank, pp_size=2):
            stages.append(_kvray_model(config, hf.state_dict()))
    assert [s.model.start_layer for s in stages] == [0, 2]
    assert [s.model.end_layer for s in stages] == [2, 3]
    # Tied head on a stage without the embedding: loaded from embed_tokens all the same.
    assert stages[0].lm_head is None and stages[1].model.embed_tokens is None
    ids = _prompt(7, seed=10)
    meta, positions = PagedCache(stages[0]).meta({"a": ids})
    for stage in stages:
        bind_kv_caches(stage, [None] * len(attention_layers(stage)))
    with torch.no_grad(), forward_context(meta):
        handoff = stages[0](torch.tensor(ids), positions)
        assert set(handoff) == {"hidden_states", "residual"}
        logits = stages[1].compute_logits(stages[1](None, positions, handoff))
    _close(logits, hf_logits(hf, ids))


def _tp_worker(rank: int, tmp: str, config, state_dict, steps) -> None:
    torch.set_num_threads(1)  # two ranks on CI's two cores
    init_distributed(
        tp_size=2, pp_size=1, rank=rank, backend="gloo", init_method=f"file://{tmp}/rdv"
    )
    try:
        model = _kvray_model(config, state_dict)
        cache = PagedCache(model)
        outs = [cache.step(step) for step in steps]
        if rank == 0:
            torch.save(outs, f"{tmp}/logits.pt")
    finally:
        destroy_distributed()


def test_tensor_parallel_two_ranks_match_transformers(tmp_path):
    # Qwen2: q/k/v biases are sharded too; an odd vocab leaves the last vocab shard padded.
    vocab = 251
    config = Qwen2Config(**{**SMALL, "vocab_size": vocab}, architectures=["Qwen2ForCausalLM"])
    hf = _random_hf_model(config, seed=2)
    a = [t % vocab for t in _prompt(6, seed=11)]
    b = [t % vocab for t in _prompt(4, seed=12)]
    a[0], b[0] = vocab - 1, 3  # ids from both halves of the vocabulary
    steps = [{"a": a[:5], "b": b}, {"a": a[5:]}]
    # spawn, not fork: the test session may hold a running Ray (its threads and sockets), and
    # a forked copy of that process can crash on its own state.
    args = (str(tmp_path), config, hf.state_dict(), steps)
    mp.start_processes(_tp_worker, args=args, nprocs=2, start_method="spawn")
    outs = torch.load(tmp_path / "logits.pt")
    assert outs[0]["a"].shape == (5, vocab)
    _close(torch.cat([outs[0]["a"], outs[1]["a"]]), hf_logits(hf, a))
    _close(outs[0]["b"], hf_logits(hf, b))


def test_tensor_parallel_shards_are_the_full_weights_split():
    config = LlamaConfig(**SMALL)
    hf = _random_hf_model(config)
    sd = hf.state_dict()
    shards = []
    for rank in range(2):
        with override_parallel_state(tp_rank=rank, tp_size=2):
            shards.append(_kvray_model(config, sd))
    qkv = [s.model.layers[0].self_attn.qkv_proj.weight for s in shards]
    q, k = (
        sd["model.layers.0.self_attn.q_proj.weight"],
        sd["model.layers.0.self_attn.k_proj.weight"],
    )
    assert torch.equal(torch.cat([w[:32] for w in qkv]), q)  # 2 of 4 heads x 16 per rank
    assert torch.equal(torch.cat([w[32:48] for w in qkv]), k)
    down = [s.model.layers[1].mlp.down_proj.weight for s in shards]
    assert torch.equal(torch.cat(down, dim=1), sd["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (6, 3, 2, "num_key_value_heads=3 is not divisible by tensor_parallel_size=2"),
        (6, 2, 4, "num_attention_heads=6 is not divisible by tensor_parallel_size=4"),
    ],
)
def test_head_counts_must_divide_tensor_parallel_size(heads, kv_heads, tp, message):
    config = LlamaConfig(
        **{
            **SMALL,
            "hidden_size": 96,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )
    with override_parallel_state(tp_size=tp), pytest.raises(ValueError, match=message):
        LlamaForCausalLM(config)


def test_load_weights_rejects_unknown_names_and_wrong_shapes():
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.bogus.weight"):
        model.load_weights([("model.layers.0.self_attn.bogus.weight", torch.zeros(4))])
    wrong = torch.zeros(16, 64)
    with pytest.raises(ValueError, match=r"k_proj.weight.*\(16, 64\).*\(32, 64\)"):
        model.load_weights([("model.layers.1.self_attn.k_proj.weight", wrong)])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(65,\).*\(64,\)"):
        model.load_weights([("model.norm.weight", torch.zeros(65))])


def test_load_weights_skips_rotary_inv_freq_and_reports_incomplete_packs():
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    q = torch.zeros(64, 64)
    loaded = model.load_weights(
        [
            ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)),
            ("model.layers.0.self_attn.q_proj.weight", q),
        ]
    )
    assert loaded == set()  # qkv_proj still lacks k and v


def test_bind_kv_caches_checks_count_and_shape():
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="1 KV caches for 2 attention layers"):
        bind_kv_caches(model, [torch.zeros(2, 4, 4, 2, 16)])
    with pytest.raises(ValueError, match="expected"):
        bind_kv_caches(model, [torch.zeros(2, 4, 4, 4, 16)] * 2)


def test_sliding_window_longer_sequences_are_refused():
    config = MistralConfig(**SMALL, sliding_window=8)
    model = get_model_class(["MistralForCausalLM"])(config)
    assert model.sliding_window == 8
    cache = PagedCache(model)
    cache.step({"a": _prompt(8, seed=13)})
    with pytest.raises(ValueError, match="sliding_window=8"):
        cache.step({"a": [1]})


def _hf_rotary_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_rotary_cache_matches_transformers(rope):
    kw = {"rope_parameters": dict(rope)} if rope else {"rope_theta": 10000.0}
    config = LlamaConfig(**{**SMALL, "num_attention_heads": 2}, head_dim=32, **kw)
    rotary = get_rope(config, 32)
    positions = torch.arange(config.max_position_embeddings)
    cos, sin = _hf_rotary_cos_sin(config, positions)
    assert rotary.cos_sin_cache.dtype == torch.float32
    torch.testing.assert_close(rotary.cos_sin_cache[:, :16], cos[:, :16], atol=1e-6, rtol=0)
    torch.testing.assert_close(rotary.cos_sin_cache[:, 16:], sin[:, :16], atol=1e-6, rtol=0)


def test_llama3_rope_covers_all_three_bands_and_reads_legacy_config():
    """The scaled test config must exercise kept, blended and slowed frequencies."""
    plain = compute_inv_freq(32, 10000.0, {"rope_type": "default"})
    scaled = compute_inv_freq(32, 10000.0, LLAMA3_ROPE)
    ratio = (plain / scaled).tolist()
    assert any(math.isclose(r, 1.0) for r in ratio)
    assert any(math.isclose(r, 4.0) for r in ratio)
    assert any(1.01 < r < 3.99 for r in ratio)
    legacy = SimpleNamespace(
        rope_theta=10000.0,
        rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
        | {"type": "llama3"},
        max_position_embeddings=256,
    )
    theta, scaling = rope_config(legacy)
    assert theta == 10000.0
    assert torch.equal(compute_inv_freq(32, theta, scaling), scaled)


def test_unsupported_rope_type_names_it():
    config = SimpleNamespace(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0},
        max_position_embeddings=64,
    )
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        get_rope(config, 16)


class PluginModel(torch.nn.Module):
    """Stands in for a model package that kvray does not ship."""

    def __init__(self, config):
        super().__init__()
        self.config = config


def test_registry_maps_architectures_and_names_unknown_ones():
    assert get_model_class(["Qwen3ForCausalLM"]).qk_norm
    assert get_model_class(["FooForCausalLM", "LlamaForCausalLM"]) is LlamaForCausalLM
    with pytest.raises(ValueError, match=r"FooForCausalLM.*supported: LlamaForCausalLM"):
        get_model_class(["FooForCausalLM"])


def test_registry_plugins_from_environment(monkeypatch):
    target = f"{__name__}:PluginModel"
    monkeypatch.setenv(PLUGIN_ENV, f"MyPluginForCausalLM={target}, LlamaForCausalLM={target}")
    assert get_model_class(["MyPluginForCausalLM"]) is PluginModel
    assert get_model_class(["LlamaForCausalLM"]) is PluginModel  # a plugin overrides a built-in
    assert get_model_class(["Qwen2ForCausalLM"]).qkv_bias


@pytest.mark.parametrize("entry", ["NoEquals", "Arch=module_without_class", "=mod:Cls"])
def test_registry_malformed_plugin_entry_is_named(monkeypatch, entry):
    monkeypatch.setenv(PLUGIN_ENV, f"Good=mod:Cls,{entry}")
    with pytest.raises(ValueError, match=f"malformed {PLUGIN_ENV} entry '{entry}'"):
        get_model_class(["LlamaForCausalLM"])


def test_registry_unimportable_plugin_is_named(monkeypatch):
    monkeypatch.setenv(PLUGIN_ENV, "Gone=no_such_package.models:Gone")
    with pytest.raises(ValueError, match="Gone=no_such_package.models:Gone"):
        get_model_class(["Gone"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama3-rope", "qwen2", "qwen3"])
def test_cuda_kernels_chunked_prefill_and_decode_match_transformers(arch):
    """Triton kernels on strided q/k views of the fused qkv (and Qwen3's normed heads)."""
    config = _configs()[arch]
    hf = _random_hf_model(config)
    with torch.device("cuda"):
        model = _kvray_model(config, hf.state_dict())
    a, b = _prompt(21, seed=20), _prompt(9, seed=21)
    cache = PagedCache(model, seed=22)
    first = cache.step({"a": a[:13], "b": b[:8]})
    second = cache.step({"a": a[13:], "b": b[8:]})
    decode = [cache.step({"b": [t]})["b"] for t in _prompt(3, seed=23)]
    _close(torch.cat([first["a"], second["a"]]), hf_logits(hf, a))
    b_full = b + _prompt(3, seed=23)
    _close(torch.cat([first["b"], second["b"], *decode]), hf_logits(hf, b_full))
