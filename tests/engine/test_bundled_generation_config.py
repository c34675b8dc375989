"""The bundled SmolLM2 comes with its generation config: requests that set no sampling take
its makers' temperature and top_p, not the API's temperature 1."""

from __future__ import annotations

from engine.bundled import BUNDLED_GENERATION_CONFIG, bundled_model_path, is_bundled_model
from engine.generation_config import GenerationDefaults, read_generation_defaults


def test_auto_gives_the_bundled_model_its_shipped_defaults():
    defaults = read_generation_defaults("auto", bundled_model_path())
    assert defaults == GenerationDefaults({"temperature": 0.2, "top_p": 0.9}, None, (2,))
    assert defaults.as_sampling_args() == {"temperature": 0.2, "top_p": 0.9}
    assert read_generation_defaults("auto", str(bundled_model_path())) == defaults


def test_vllm_keeps_the_engine_s_own_defaults_for_the_bundled_model():
    assert read_generation_defaults("vllm", bundled_model_path()) == GenerationDefaults()


def test_another_gguf_file_has_no_generation_defaults(tmp_path):
    other = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    other.write_bytes(bundled_model_path().read_bytes()[:64])
    assert not is_bundled_model(other)
    assert read_generation_defaults("auto", other) == GenerationDefaults()


def test_the_shipped_ids_agree_with_the_model_s_own():
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(bundled_model_path())
    assert BUNDLED_GENERATION_CONFIG["eos_token_id"] == tokenizer.eos_token_id
    assert BUNDLED_GENERATION_CONFIG["bos_token_id"] == tokenizer.bos_token_id


def test_the_bundled_engine_samples_with_the_shipped_defaults_when_a_request_sets_none():
    from engine import LLM

    llm = LLM(max_model_len=256)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (
        BUNDLED_GENERATION_CONFIG["temperature"],
        BUNDLED_GENERATION_CONFIG["top_p"],
    )
