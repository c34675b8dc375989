"""A model's generation_config.json: sampling defaults, default length, every EOS id."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.api.protocol import CompletionRequest
from engine.api.serving import OpenAIServing
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.generation_config import (
    GenerationDefaults,
    end_of_sequence_ids,
    read_generation_defaults,
)
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.support.fakes import ScriptedEngine, scripted_chat, scripted_completion
from tests.support.tiny_models import TINY_ARGS, write_tiny_llama

PROMPT = [5, 17, 99, 3]
EXTRA_EOS = 7
"""An id the tiny model's config.json does not call EOS (its eos_token_id is 2)."""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gen")
    write_tiny_llama(folder)
    (folder / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": [2, EXTRA_EOS], "temperature": 0.0, "max_new_tokens": 5, "top_k": 20}
        )
    )
    return folder


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder):
    return LLM(str(tiny_folder), **TINY_ARGS)


def _tokens(llm: LLM, params: SamplingParams | None = None) -> tuple[list[int], str]:
    out = llm.generate([PROMPT], params)[0].outputs[0]
    return out.token_ids, out.finish_reason


def test_the_file_s_values_are_read_and_only_those(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True, "eos_token_id": 9})
    )
    defaults = read_generation_defaults("auto", tmp_path)
    assert defaults == GenerationDefaults({"temperature": 0.6, "top_p": 0.9}, None, (9,))
    assert read_generation_defaults("vllm", tmp_path) == GenerationDefaults()
    assert read_generation_defaults("auto", tmp_path / "missing") == GenerationDefaults()
    assert read_generation_defaults("auto", None) == GenerationDefaults()
    assert read_generation_defaults(str(tmp_path), None).sampling["top_p"] == 0.9


@pytest.mark.parametrize(
    "content, problem",
    [('{"temperature": -1}', "temperature"), ("[1, 2]", "JSON object"), ("{", "cannot read")],
)
def test_a_bad_file_fails_naming_it(tmp_path, content, problem):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=problem) as info:
        read_generation_defaults("auto", tmp_path)
    assert "generation_config" in str(info.value)


def test_a_folder_without_the_file_is_refused_at_config_time(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig.create(generation_config=str(tmp_path), device="cpu")
    EngineConfig.create(generation_config="vllm", device="cpu")
    # An empty setting names no folder, even where the working directory holds the file.
    (tmp_path / "generation_config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig.create(generation_config="", device="cpu")


def test_eos_ids_come_from_config_tokenizer_and_file_primary_first():
    class Config:
        eos_token_id = [128001, 128008]

    class Tokenizer:
        eos_token_id = 128009

    defaults = GenerationDefaults(eos_token_ids=(128001, 128009, 5))
    assert end_of_sequence_ids(Config, Tokenizer, defaults) == [128001, 128008, 128009, 5]
    Config.eos_token_id = None
    assert end_of_sequence_ids(Config, None, GenerationDefaults()) == []


def test_an_eos_id_of_the_generation_config_ends_a_request(tiny_llm, tiny_folder):
    forced = dict(temperature=0, max_tokens=8, logit_bias={EXTRA_EOS: 100})
    assert _tokens(tiny_llm, SamplingParams(**forced)) == ([EXTRA_EOS], "stop")
    # min_tokens holds it back like EOS; ignore_eos lets it through.
    tokens, reason = _tokens(tiny_llm, SamplingParams(**forced, min_tokens=3))
    assert (len(tokens), tokens[-1], reason) == (4, EXTRA_EOS, "stop")
    assert EXTRA_EOS not in tokens[:3]
    assert _tokens(tiny_llm, SamplingParams(**forced, ignore_eos=True)) == (
        [EXTRA_EOS] * 8,
        "length",
    )
    # The request's own stop_token_ids are kept beside it.
    params = SamplingParams(**forced, stop_token_ids=[11])
    tiny_llm.generate([PROMPT], params)
    assert params.stop_token_ids == [11]

    plain = LLM(str(tiny_folder), generation_config="vllm", **TINY_ARGS)
    assert _tokens(plain, SamplingParams(**forced)) == ([EXTRA_EOS] * 8, "length")


def test_generate_without_params_takes_the_model_s_defaults(tiny_llm, tiny_folder):
    greedy, _ = _tokens(tiny_llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert tiny_llm.get_default_sampling_params().top_k == 20
    # temperature 0 and max_new_tokens 5 from the file (its EOS ids may end it sooner).
    tokens, _ = _tokens(tiny_llm)
    assert tokens == greedy[: len(tokens)] and 1 <= len(tokens) <= 5

    plain = LLM(str(tiny_folder), generation_config="vllm", **TINY_ARGS)
    tokens, _ = _tokens(plain)
    assert len(tokens) == 16 and tokens[:5] != greedy  # SamplingParams(): temperature 1


def test_an_engine_process_reports_the_defaults(tiny_folder):
    engine = AsyncEngine.from_engine_args(
        model=str(tiny_folder),
        engine_process=True,
        served_model_name=["tiny", "alias"],
        **TINY_ARGS,
    )
    try:
        defaults = engine.generation_defaults
        names = (engine.model_name, engine.served_model_names)
    finally:
        engine.shutdown()
    assert names == ("tiny", ["tiny", "alias"])
    assert defaults.sampling == {"temperature": 0.0, "top_k": 20}
    assert (defaults.max_tokens, defaults.eos_token_ids) == (5, (2, EXTRA_EOS))


def _served_params(tokenizer, request) -> SamplingParams:
    engine = ScriptedEngine(tokenizer)
    engine.generation_defaults = GenerationDefaults({"temperature": 0.6, "top_k": 20}, 3)
    serving = OpenAIServing(engine)
    if isinstance(request, CompletionRequest):
        asyncio.run(serving.create_completion(request))
    else:
        asyncio.run(serving.create_chat_completion(request))
    return engine.calls[-1]["params"]


def test_the_api_fills_unset_fields_from_the_model_s_defaults(bundled_tokenizer):
    completion = _served_params(bundled_tokenizer, scripted_completion())
    assert (completion.temperature, completion.top_k, completion.max_tokens) == (0.6, 20, 3)
    chat = _served_params(bundled_tokenizer, scripted_chat(temperature=0.2))
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.2, 20, 3)
    # A length the request asks for is its own.
    assert _served_params(bundled_tokenizer, scripted_completion(max_tokens=9)).max_tokens == 9
