"""Weight loading: HF safetensors folders (single and sharded), the bundled GGUF, dummy shapes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from engine import LLM, SamplingParams
from engine.bundled import bundled_model_path
from engine.config import EngineArgs
from engine.layers.norm import RMSNorm
from engine.models.registry import architectures_of, get_model_class
from engine.models.shapes import SHAPE_NAMES, get_shape_config
from engine.worker.loader import ModelSource, load_hf_config, load_model, resolve_model_source
from tests.support.bundled_checkpoints import logits_of

CPU = torch.device("cpu")


def _tiny_config(**kw) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        **kw,
    )


def unpacked_state_dict(model) -> dict[str, torch.Tensor]:
    """kvray's parameters under HF names, packed q/k/v and gate/up split apart."""
    out = {}
    for name, p in model.state_dict().items():
        if ".qkv_proj." in name:
            attn = model.model.layers[int(name.split(".")[2])].self_attn
            q, k, v = p.split([attn.q_size, attn.kv_size, attn.kv_size])
            for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", proj)] = t
        elif ".gate_up_proj." in name:
            gate, up = p.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = p
    return out


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_tiny_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    single = tmp_path_factory.mktemp("single")
    hf.save_pretrained(single, safe_serialization=True)
    sharded = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="60KB")
    return hf, single, sharded


def _load(path: Path, **kw):
    source = resolve_model_source(str(path))
    return load_model(source, load_hf_config(source), torch.float32, CPU, **kw)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_safetensors_folder_loads_transformers_weights(hf_tiny, layout):
    hf, single, sharded = hf_tiny
    folder = single if layout == "single" else sharded
    if layout == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 2
    model = _load(folder)
    assert not model.training
    ours = unpacked_state_dict(model)
    theirs = hf.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    ids = [5, 17, 300, 2, 99, 41]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(model, ids), expected, atol=1e-4, rtol=1e-4)


def test_a_model_without_a_tokenizer_refuses_stop_strings_and_stops_on_token_ids(hf_tiny):
    _, single, _ = hf_tiny
    assert not list(single.glob("tokenizer*"))
    llm = LLM(str(single), max_model_len=64, dtype="float32")
    prompt = [5, 17, 300, 2]
    with pytest.raises(ValueError, match="stop needs the model's tokenizer"):
        llm.generate([prompt], SamplingParams(max_tokens=4, stop=["a"]))
    assert not llm.engine.has_unfinished_requests()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    assert len(ids) == 6
    stop_at = ids[2]
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at])
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_at) + 1] and out.finish_reason == "stop"


def test_bfloat16_load_keeps_rope_table_float32(hf_tiny):
    _, single, _ = hf_tiny
    source = resolve_model_source(str(single))
    model = load_model(source, load_hf_config(source), torch.bfloat16, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored after building


def test_missing_shard_is_named(hf_tiny, tmp_path):
    _, _, sharded = hf_tiny
    folder = tmp_path / "model"
    shutil.copytree(sharded, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (folder / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        _load(folder)


def test_wrong_tensor_shape_names_file_and_tensor(hf_tiny, tmp_path):
    _, single, _ = hf_tiny
    folder = tmp_path / "model"
    shutil.copytree(single, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight.*\(95, 64\)"
    ):
        _load(folder)


def test_missing_tensor_is_named(hf_tiny, tmp_path):
    _, single, _ = hf_tiny
    folder = tmp_path / "model"
    shutil.copytree(single, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    # named as the checkpoint names it, not as the fused qkv_proj that lacks it
    with pytest.raises(ValueError, match=r"for model\.layers\.0\.self_attn\.v_proj\.weight$"):
        _load(folder)


def test_folder_without_weights_is_an_error(tmp_path):
    _tiny_config().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        _load(tmp_path)


def test_unknown_architecture_is_named(tmp_path):
    config = _tiny_config()
    config.architectures = ["FancyNewForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        _load(tmp_path)


def test_a_checkpoint_of_an_unsupported_quant_method_is_refused_naming_it(hf_tiny, tmp_path):
    """Its tensors would otherwise load as plain weights (or fail on the first scale)."""
    _, single, _ = hf_tiny
    folder = tmp_path / "bnb"
    shutil.copytree(single, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    hf_config = load_hf_config(resolve_model_source(str(folder)))
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' is not supported"):
        EngineArgs(model=str(folder), device="cpu").create_engine_config(hf_config)
    # Dummy weights of its shape need no tensor of it.
    dummy = EngineArgs(model=str(folder), load_format="dummy", device="cpu")
    assert dummy.create_engine_config(hf_config).model.quantization == "none"


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_source(str(missing))
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        resolve_model_source("llama3-8b")


def test_resolve_model_source_kinds(hf_tiny):
    _, single, _ = hf_tiny
    assert resolve_model_source(None) == ModelSource("gguf", str(bundled_model_path()))
    assert resolve_model_source(str(single)) == ModelSource("hf", str(single))
    assert resolve_model_source("qwen3-0.6b", "dummy") == ModelSource("dummy", "qwen3-0.6b")
    assert resolve_model_source(str(single), "dummy") == ModelSource("dummy", str(single))
    with pytest.raises(ValueError, match="load_format must be one of"):
        resolve_model_source(str(single), "pickle")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        resolve_model_source(str(single), "gguf")


def test_dummy_tiny_llama_is_seeded_and_runs():
    source = resolve_model_source("tiny-llama", "dummy")
    config = load_hf_config(source)
    a = load_model(source, config, torch.float32, CPU, seed=1)
    b = load_model(source, config, torch.float32, CPU, seed=1)
    c = load_model(source, config, torch.float32, CPU, seed=2)
    wa, wb, wc = (m.model.layers[0].mlp.down_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert 0.015 < wa.std().item() < 0.025
    for module in a.modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == 1)
    logits = logits_of(a, [1, 2, 3])
    assert logits.shape == (3, config.vocab_size) and torch.isfinite(logits).all()


def test_dummy_from_folder_config_and_sliding_window_limit(tmp_path):
    MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=16,
        architectures=["MistralForCausalLM"],
    ).save_pretrained(tmp_path)
    source = resolve_model_source(str(tmp_path), "dummy")
    config = load_hf_config(source)
    model = load_model(source, config, torch.float32, CPU, max_model_len=16)
    assert type(model).__name__ == "MistralForCausalLM"
    with pytest.raises(ValueError, match="max_model_len=17 exceeds the model's sliding_window=16"):
        load_model(source, config, torch.float32, CPU, max_model_len=17)


# Published parameter counts; tied embeddings counted once.
PUBLISHED_PARAMS = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "qwen3-0.6b": 596_049_920,
    "qwen2.5-7b": 7_615_616_512,
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_named_shape_builds_with_the_published_size(name):
    config = get_shape_config(name)
    with torch.device("meta"):
        model = get_model_class(architectures_of(config))(config)
    num_params = sum(p.numel() for p in model.parameters())
    if name in PUBLISHED_PARAMS:
        assert num_params == PUBLISHED_PARAMS[name]
    else:
        assert num_params < 10_000_000


def test_unknown_shape_lists_known_ones():
    with pytest.raises(ValueError, match="known: .*llama3-8b.*tiny-llama"):
        get_shape_config("gpt-5")


@pytest.fixture(scope="module")
def bundled(hf):
    source = resolve_model_source(None)
    config = load_hf_config(source)
    ours = load_model(source, config, torch.float32, CPU)
    return config, ours, hf[1]


def test_smollm2_shape_matches_the_bundled_config(bundled):
    config, *_ = bundled
    shape = get_shape_config("smollm2-135m")
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_parameters",
    ):
        assert getattr(shape, field) == getattr(config, field), field
    assert shape.rms_norm_eps == pytest.approx(config.rms_norm_eps)


def test_bundled_gguf_weights_equal_transformers(bundled):
    _, ours, theirs = bundled
    mine = unpacked_state_dict(ours)
    for name, tensor in theirs.state_dict().items():
        if name == "lm_head.weight":  # tied: it is the embedding
            name = "model.embed_tokens.weight"
        torch.testing.assert_close(mine[name], tensor, atol=0, rtol=0, msg=name)


def test_bundled_gguf_logits_match_transformers(bundled):
    _, ours, theirs = bundled
    ids = torch.randint(0, 49152, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0]
    got = logits_of(ours, ids)
    torch.testing.assert_close(got, expected, atol=5e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
