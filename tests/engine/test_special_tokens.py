"""A tokenizer that puts a BOS before every text (as Llama 3's and Mistral's do): text
prompts get it as vLLM gives it (completions, /tokenize of a prompt and offline
generation add it; chats leave it to the template), and `add_special_tokens` turns it
either way. The tokenizers of SmolLM2 and of the benchmark add nothing, so only such a
tokenizer can show the difference."""

from __future__ import annotations

import asyncio
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from engine.api.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from engine.api.serving import OpenAIServing, RequestContext
from engine.async_engine import AsyncEngine
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from tests.support.tiny_models import TINY_ARGS, write_tiny_llama

BOS, EOS = 1, 2
TEXT = "w5 w6 w7"
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny random Llama (vocab 256) with a word-level tokenizer whose post-processor
    writes <s> (id 1) before every text."""
    folder = tmp_path_factory.mktemp("bos-llama")
    write_tiny_llama(folder)
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, 256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def served(folder):
    engine = AsyncEngine.from_engine_args(model=str(folder), engine_process=False, **TINY_ARGS)
    yield OpenAIServing(engine)
    engine.shutdown()


def test_the_tokenizer_under_test_adds_a_bos(folder):
    hf = load_tokenizer(folder)
    assert hf.encode(TEXT) == [BOS, 5, 6, 7]
    assert hf.encode(TEXT, add_special_tokens=False) == [5, 6, 7]


def test_offline_text_prompts_get_the_bos_as_transformers_encodes_them(folder):
    llm = LLM(str(folder), **TINY_ARGS)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_text = llm.generate([TEXT], greedy)[0]
    by_ids = llm.generate([load_tokenizer(folder).encode(TEXT)], greedy)[0]
    assert by_text.prompt_token_ids == [BOS, 5, 6, 7]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def _completion_ids(served: OpenAIServing, **fields) -> list[int]:
    request = CompletionRequest(prompt=TEXT, max_tokens=2, return_token_ids=True, **fields)
    response = asyncio.run(served.create_completion(request, RequestContext()))
    return response.choices[0].prompt_token_ids


def _chat_ids(served: OpenAIServing, **fields) -> list[int]:
    messages = [{"role": "user", "content": TEXT}]
    request = ChatCompletionRequest(
        messages=messages, max_tokens=2, return_token_ids=True, **fields
    )
    response = asyncio.run(served.create_chat_completion(request, RequestContext()))
    return response.prompt_token_ids


def test_completions_add_the_bos_unless_asked_not_to(served):
    assert _completion_ids(served) == [BOS, 5, 6, 7]
    assert _completion_ids(served, add_special_tokens=False) == [5, 6, 7]
    request = CompletionRequest(prompt=[TEXT, "w9"], max_tokens=1, return_token_ids=True)
    response = asyncio.run(served.create_completion(request, RequestContext()))
    assert [c.prompt_token_ids for c in response.choices] == [[BOS, 5, 6, 7], [BOS, 9]]


def test_token_id_prompts_are_taken_as_given(served):
    request = CompletionRequest(prompt=[5, 6, 7], max_tokens=1, return_token_ids=True)
    response = asyncio.run(served.create_completion(request, RequestContext()))
    assert response.choices[0].prompt_token_ids == [5, 6, 7]


def test_chats_keep_the_template_s_one_bos_unless_asked_for_another(served):
    assert _chat_ids(served) == [BOS, 5, 6, 7]
    assert _chat_ids(served, add_special_tokens=True) == [BOS, BOS, 5, 6, 7]


def test_tokenize_counts_as_the_endpoint_it_stands_for(served):
    def ids(**fields) -> list[int]:
        return asyncio.run(served.tokenize(TokenizeRequest(**fields))).tokens

    messages = [{"role": "user", "content": TEXT}]
    assert ids(prompt=TEXT) == _completion_ids(served) == [BOS, 5, 6, 7]
    assert ids(prompt=TEXT, add_special_tokens=False) == [5, 6, 7]
    assert ids(messages=messages) == _chat_ids(served) == [BOS, 5, 6, 7]
    assert ids(messages=messages, add_special_tokens=True) == [BOS, BOS, 5, 6, 7]
