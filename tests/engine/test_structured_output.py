"""JSON-constrained sampling: the sampler's mask, then the engine on the bundled model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutput
from engine.async_engine import AsyncEngine
from engine.outputs import RequestFailedError
from engine.sampling_params import StructuredOutputError
from engine.worker.sampler import build_sampling_batch, sample

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _bitmask(allowed: list[int], vocab_size: int) -> np.ndarray:
    words = np.zeros(-(-vocab_size // 32), dtype=np.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words.astype(np.uint32).view(np.int32)


def test_masked_rows_sample_only_allowed_tokens_and_the_others_are_untouched():
    _check_masked_sampling("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_masked_rows_sample_only_allowed_tokens_and_the_others_are_untouched():
    _check_masked_sampling("cuda")


def _check_masked_sampling(device: str) -> None:
    vocab, gen = 100, torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab + 12, generator=gen).to(device)  # padded past the vocabulary
    allowed = [[3, 31, 32, 63, 99], None, [7], None]
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=2),
    ]
    for _ in range(20):
        batch = build_sampling_batch(
            params,
            [[]] * 4,
            [[]] * 4,
            [torch.Generator(device).manual_seed(i) for i in range(4)],
            None,
            vocab,
            device,
            token_bitmasks=[None if a is None else _bitmask(a, vocab) for a in allowed],
        )
        tokens = sample(logits, batch).token_ids
        assert tokens[0] in allowed[0] and tokens[2] == 7
        assert tokens[1] == int(logits[1, :vocab].argmax())
    reference = build_sampling_batch(
        params[3:], [[]], [[]], [torch.Generator(device).manual_seed(3)], None, vocab, device
    )
    assert tokens[3] == sample(logits[3:], reference).token_ids[0]


def test_allowed_token_ids_narrow_sampling_alone_and_beside_a_grammar_mask():
    vocab, gen = 100, torch.Generator().manual_seed(0)
    allowed = [3, 31, 32, 63, 99]  # both ends of 32-bit words
    params = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    assert np.array_equal(params.allowed_bitmask(vocab), _bitmask(allowed, vocab))
    logits = torch.randn(2, vocab, generator=gen)
    seen = set()
    for step in range(30):
        generators = [torch.Generator().manual_seed(step), torch.Generator().manual_seed(-step)]
        grammar = [None, _bitmask([31, 32, 50], vocab)]
        batch = build_sampling_batch(
            [params, params], [[]] * 2, [[]] * 2, generators, None, vocab, "cpu",
            token_bitmasks=grammar,
        )  # fmt: skip
        alone, beside = sample(logits, batch).token_ids
        assert alone in allowed and beside in (31, 32)  # the grammar's and the ids' overlap
        seen.add(alone)
    assert len(seen) > 1
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def _chat_ids(llm, content: str) -> list[int]:
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(text, add_special_tokens=False)


def test_a_schema_shapes_the_output_and_leaves_its_batch_neighbours_alone(llm):
    ids = _chat_ids(llm, "Give me a person as JSON with a name and an age.")
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate([ids], free)[0].outputs[0]
    person = SamplingParams(
        temperature=0.0, max_tokens=64, structured_output=StructuredOutput(json.dumps(PERSON))
    )
    shaped, neighbour = (o.outputs[0] for o in llm.generate([ids, ids], [person, free]))
    value = json.loads(shaped.text)
    assert shaped.finish_reason == "stop"
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    assert neighbour.token_ids == alone.token_ids
    assert not alone.text.startswith("{")  # free text here: the schema made the difference


def test_json_object_outputs_parse_for_sampled_requests_and_each_of_n(llm):
    ids = _chat_ids(llm, "Describe a cat in JSON.")
    params = SamplingParams(
        n=2, temperature=1.0, seed=7, max_tokens=96, structured_output=StructuredOutput()
    )
    for out in llm.generate([ids, ids[:-3]], params):
        for choice in out.outputs:
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.text), dict)
            else:  # out of tokens: still a prefix of one JSON object
                assert choice.text.startswith("{")


def test_a_regex_a_choice_and_a_grammar_shape_the_output(llm):
    ids = _chat_ids(llm, "Name a city and a year.")
    regex = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    choices = ['say "hi"', "a\\b", "line\nbreak"]  # quotes, backslashes, newlines escaped
    specs = [
        StructuredOutput(regex=regex),
        StructuredOutput(choice=choices),
        StructuredOutput(grammar='root ::= "The answer is " ("yes" | "no") "."'),
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_output=spec) for spec in specs
    ]
    shaped = [o.outputs[0] for o in llm.generate([ids] * 3, params)]
    assert all(s.finish_reason == "stop" for s in shaped)
    assert re.fullmatch(regex, shaped[0].text)
    assert shaped[1].text in choices
    assert re.fullmatch(r"The answer is (yes|no)\.", shaped[2].text)


def test_a_grammar_after_a_preamble_applies_from_the_token_after_its_end(llm):
    # A reasoning model's thought is free and its answer follows the grammar: here the
    # "thought" ends with the first three tokens the model writes unconstrained.
    ids = _chat_ids(llm, "Name a city and a year.")
    free = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    assert not re.match(r"[0-9]", free.text)
    end = tuple(free.token_ids[1:3])
    regex = r"[0-9]{3}"
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            structured_output=StructuredOutput(regex=regex, starts_after_token_ids=after),
        )
        for after in (end, (len(llm.engine.tokenizer) - 1,) * 2)
    ]
    gated, never = (o.outputs[0] for o in llm.generate([ids, ids], params))
    assert gated.token_ids[:3] == free.token_ids[:3]
    preamble = llm.engine.tokenizer.decode(free.token_ids[:3])
    assert gated.text.startswith(preamble) and re.fullmatch(regex, gated.text[len(preamble) :])
    assert gated.finish_reason == "stop"
    assert never.token_ids == free.token_ids  # the end never came: free all along
    with pytest.raises(ValueError, match="starts_after_token_ids must not be empty"):
        StructuredOutput(regex="a", starts_after_token_ids=())
    assert StructuredOutput(starts_after_token_ids=[1, 2]).starts_after_token_ids == (1, 2)
    for bad in (5, "ab", [1, "2"]):  # an int was a TypeError
        with pytest.raises(StructuredOutputError, match="list of token ids"):
            StructuredOutput(regex="a", starts_after_token_ids=bad)


def test_one_kind_of_structured_output_at_a_time():
    with pytest.raises(ValueError, match="regex and choice"):
        StructuredOutput(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutput(choice=[])
    assert StructuredOutput(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutput().kind == "json_object"


def test_a_mask_is_built_only_for_steps_that_sample():
    # The prompt goes in chunks of 16 tokens: only the last chunk and the decodes sample.
    llm = LLM(max_model_len=512, max_num_batched_tokens=16, max_num_seqs=4)
    ids = _chat_ids(llm, "Describe a cat in JSON, with its name, colour and age.")
    assert len(ids) > 2 * 16
    masks = []
    bitmask = llm.engine.structured.bitmask

    def counted_bitmask(request_id):
        masks.append(request_id)
        return bitmask(request_id)

    llm.engine.structured.bitmask = counted_bitmask
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_output=StructuredOutput())
    out = llm.generate([ids], params)[0].outputs[0]
    assert out.text.startswith("{")
    assert len(masks) == len(out.token_ids)


def test_a_schema_that_cannot_be_followed_is_refused_and_the_engine_goes_on(llm):
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput('{"type": "objectx"}'))
    with pytest.raises(ValueError, match="structured_output"):
        llm.engine.add_request("bad", [1, 2, 3], bad)
    with pytest.raises(ValueError, match="structured_output"):
        StructuredOutput({"type": "object"})  # a dict, not schema text
    for spec, reason in [
        (StructuredOutput(regex="("), "regular expression .*parenthesis"),
        (StructuredOutput(grammar="root ::= missing"), 'grammar .*"missing" is not defined'),
    ]:
        with pytest.raises(ValueError, match=reason):
            llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=spec))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, structured_output=StructuredOutput())
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput())
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "integer", "not": {"const": 3}}, '"not" at #/not'),
        ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
         '"uniqueItems" at #/properties/tags/uniqueItems'),
        ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, '"allOf" of several schemas at #/allOf'),
        ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 5}}, '"if" at #/if'),
        ({"type": "array", "items": {"anyOf": [{"contains": {"const": 1}}]}},
         '"contains" at #/items/anyOf/0/contains'),
        ({"$defs": {"a/b": {"dependentRequired": {"x": ["y"]}}}, "$ref": "#/$defs/a~1b"},
         '"dependentRequired" at #/$defs/a~1b/dependentRequired'),
        # Nothing matches an empty anyOf; xgrammar's grammar for it takes "".
        ({"type": "object", "properties": {"a": {"anyOf": []}}},
         '"anyOf" of no schemas at #/properties/a/anyOf'),
    ],
)  # fmt: skip
def test_a_schema_asking_what_the_grammar_would_ignore_is_refused_naming_where(llm, schema, where):
    # xgrammar compiles these and then ignores the keyword: the output would not follow it.
    params = SamplingParams(structured_output=StructuredOutput(json.dumps(schema)))
    with pytest.raises(ValueError, match="would not enforce") as info:
        llm.engine.add_request("ignored", [1, 2, 3], params)
    assert where in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_keyword_names_in_data_and_property_names_and_no_op_forms_are_followed(llm):
    schema = {
        "type": "object",
        "properties": {
            "not": {
                "type": "array",
                "items": {"enum": [1, 2]},
                "maxItems": 2,
                "uniqueItems": False,
            },
            "if": {"allOf": [{"const": {"contains": 1}}]},
        },
        "required": ["not", "if"],
        "additionalProperties": False,
    }
    ids = _chat_ids(llm, "Give me a JSON object.")
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_output=StructuredOutput(json.dumps(schema))
    )
    value = json.loads(llm.generate([ids], params)[0].outputs[0].text)
    assert set(value["not"]) <= {1, 2} and value["if"] == {"contains": 1}


def test_a_finished_grammar_allows_only_the_end_token_where_asked_again(llm):
    structured = llm.engine.structured
    eos = structured.eos_token_id
    structured.add("done", structured.grammar(StructuredOutput(choice=("yes", "no"))))
    try:
        structured.accept("done", llm.engine.tokenizer.encode("yes", add_special_tokens=False))
        before = _allowed(structured.bitmask("done"))
        structured.accept("done", [eos])
        assert eos in before and structured.matchers["done"].is_terminated()
        assert _allowed(structured.bitmask("done")).tolist() == [eos]  # xgrammar would raise
    finally:
        structured.remove("done")


def _allowed(words: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))


def test_allowed_token_ids_that_leave_nothing_to_sample_are_refused_naming_them(llm):
    # Token 0 used to come out, outside allowed_token_ids and the grammar.
    eos = llm.engine.eos_token_id
    tok = llm.engine.tokenizer
    zebra = tok.encode("zebra", add_special_tokens=False)
    assert len(zebra) > 1
    refused = [
        SamplingParams(min_tokens=2, allowed_token_ids=[eos]),  # held back below min_tokens
        SamplingParams(min_tokens=2, allowed_token_ids=[7], stop_token_ids=[7]),
        SamplingParams(
            allowed_token_ids=[5, 6], structured_output=StructuredOutput(choice=["zebra"])
        ),
        SamplingParams(allowed_token_ids=[eos], structured_output=StructuredOutput()),
    ]
    for params in refused:
        with pytest.raises(ValueError, match="^allowed_token_ids ") as info:
            llm.engine.add_request("nothing", [1, 2, 3], params)
        assert "nothing could be sampled" in str(info.value) or "start with" in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    # min_tokens holds back EOS only while it ends the request.
    ids = [1, 2, 3]
    kept = SamplingParams(min_tokens=2, max_tokens=2, ignore_eos=True, allowed_token_ids=[eos])
    assert llm.generate([ids], kept)[0].outputs[0].token_ids == [eos, eos]

    # The grammar's first token is allowed, the next it needs is not: the request fails
    # at that step with the same error, and nothing is left behind.
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        allowed_token_ids=[zebra[0]],
        structured_output=StructuredOutput(choice=["zebra"]),
    )
    with pytest.raises(ValueError, match="^allowed_token_ids .* after 1 output tokens"):
        llm.generate([ids], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["kv_cache_usage"] == 0
    # The end of a complete value needs no place in allowed_token_ids.
    params = dataclasses.replace(params, allowed_token_ids=zebra)
    out = llm.generate([ids], params)[0].outputs[0]
    assert out.text == "zebra" and out.finish_reason == "stop"


def test_a_grammar_that_accepts_no_output_is_refused(llm):
    # Its first mask would allow no token at all, leaving the sampler nothing to choose.
    for spec in (
        StructuredOutput(regex="[^\\x00-\\U0010FFFF]"),
        StructuredOutput(grammar="root ::= [^\\x00-\\U0010FFFF]"),
    ):
        with pytest.raises(ValueError, match="accepts no output at all"):
            llm.engine.add_request("empty", [1, 2, 3], SamplingParams(structured_output=spec))
    assert not llm.engine.has_unfinished_requests()


def test_a_schema_compiling_holds_up_no_other_request(llm, monkeypatch):
    # Some schemas compile for seconds; the engine goes on serving the others meanwhile.
    release = threading.Event()
    compile_now = llm.engine.structured.grammar

    def slow_grammar(spec):
        release.wait(60)
        return compile_now(spec)

    monkeypatch.setattr(llm.engine.structured, "grammar", slow_grammar)
    ids = _chat_ids(llm, "Give me a person as JSON with a name and an age.")
    person = SamplingParams(
        temperature=0.0, max_tokens=64, structured_output=StructuredOutput(json.dumps(PERSON))
    )
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput('{"type": "objectx"}'))
    free = SamplingParams(temperature=0.0, max_tokens=8)

    async def outputs(request_id, params):
        return [out async for out in engine.generate(ids, params, request_id)]

    async def run():
        shaped = asyncio.ensure_future(outputs("shaped", person))
        dropped = asyncio.ensure_future(outputs("dropped", person))
        plain = await asyncio.wait_for(outputs("plain", free), 60)
        assert plain[-1].finished and len(plain[-1].outputs[0].token_ids) == 8
        assert not shaped.done()  # still compiling
        engine.abort("dropped")
        assert await asyncio.wait_for(dropped, 10) == []
        release.set()
        with pytest.raises(ValueError, match="structured_output"):
            await asyncio.wait_for(outputs("bad", bad), 60)
        return (await asyncio.wait_for(shaped, 60))[-1].outputs[0]

    engine = AsyncEngine(llm.engine)
    try:
        shaped = asyncio.run(run())
    finally:
        release.set()
        engine.shutdown()
    assert set(json.loads(shaped.text)) == {"name", "age"}
    assert not llm.engine.has_unfinished_requests()  # the aborted one never ran


def test_a_request_a_step_fails_on_fails_alone_and_the_engine_serves_on(llm, monkeypatch):
    # A grammar's mask or a sample's detokenizing that raises fails that request only: it is
    # aborted (KV freed), its caller gets the error, the others finish as they would alone.
    ids = _chat_ids(llm, "Give me a person as JSON with a name and an age.")
    person = SamplingParams(
        temperature=0.0, max_tokens=64, structured_output=StructuredOutput(json.dumps(PERSON))
    )
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    shaped_alone, free_alone = (o.outputs[0] for o in llm.generate([ids, ids], [person, free]))
    mask_now = llm.engine.structured.bitmask
    process_now = llm.engine.output_processor.process_sample
    requests = llm.engine.scheduler.requests

    def bitmask(request_id):
        if request_id == "bad-mask" and requests[request_id].num_output_tokens >= 3:
            raise RuntimeError("mask broke")
        return mask_now(request_id)

    def process_sample(sample, logprobs):
        request = sample.request
        if request.request_id.startswith("bad-text") and request.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "detokenizer broke")
        process_now(sample, logprobs)

    monkeypatch.setattr(llm.engine.structured, "bitmask", bitmask)
    monkeypatch.setattr(llm.engine.output_processor, "process_sample", process_sample)

    async def outputs(request_id, params):
        return [out async for out in engine.generate(ids, params, request_id)]

    async def run():
        names = ["shaped", "bad-mask", "free", "bad-text", "bad-text-n2"]
        kinds = [person, person, free, free, dataclasses.replace(free, n=2, temperature=1.0)]
        done = await asyncio.wait_for(
            asyncio.gather(*(outputs(n, p) for n, p in zip(names, kinds)), return_exceptions=True),
            60,
        )
        return dict(zip(names, done, strict=True))

    engine = AsyncEngine(llm.engine)
    try:
        done = asyncio.run(run())
        assert engine.is_healthy
    finally:
        engine.shutdown()
    for name, cause in (("bad-mask", "mask broke"), ("bad-text", "detokenizer broke")):
        assert isinstance(done[name], RequestFailedError), done[name]
        assert name in str(done[name]) and cause in str(done[name])
    assert isinstance(done["bad-text-n2"], RequestFailedError)
    assert done["shaped"][-1].outputs[0].token_ids == shaped_alone.token_ids
    assert done["free"][-1].outputs[0].token_ids == free_alone.token_ids
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["kv_cache_usage"] == 0

    # Offline, generate raises it, leaves nothing behind, and the next call works.
    monkeypatch.setattr(llm, "_ids", iter(["bad-text-offline", "ok-offline"]))
    with pytest.raises(RequestFailedError, match="detokenizer broke"):
        llm.generate([ids, ids], free)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["kv_cache_usage"] == 0
    monkeypatch.undo()
    assert llm.generate([ids], free)[0].outputs[0].token_ids == free_alone.token_ids
