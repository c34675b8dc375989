"""AsyncLLMEngine: the guides' `from_pretrained` and `generate` forms over AsyncEngine, on a
tiny random Llama with a word tokenizer (greedy, so every form gives the same tokens)."""

from __future__ import annotations

import asyncio

import pytest

from bench.word_tokenizer import write_word_tokenizer
from engine import AsyncLLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.sampling_params import RequestOutputKind
from tests.support.tiny_models import TINY_ARGS, write_tiny_llama

PROMPTS = ["t3 t4 t5 t6", "t9 t8 t7", "t40 t41"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_llama(folder)
    write_word_tokenizer(folder, vocab_size=256)
    eng = AsyncLLMEngine.from_pretrained(str(folder), engine_process=False, **TINY_ARGS)
    yield eng
    eng.shutdown()


async def _idle(engine: AsyncLLMEngine) -> dict:
    for _ in range(100):
        stats = await engine.stats()
        if stats["num_running"] + stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0:
            break
        await asyncio.sleep(0.02)
    return stats


def test_it_is_the_async_engine_built_from_the_engine_keys_and_their_aliases(tmp_path):
    assert issubclass(AsyncLLMEngine, AsyncEngine)
    write_tiny_llama(tmp_path)
    eng = AsyncLLMEngine.from_pretrained(
        str(tmp_path), engine_process=False, max_batch_size=3, **TINY_ARGS
    )
    try:
        assert eng.engine.config.scheduler_config.max_num_seqs == 3
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="batch_timeout must be a finite number"):
        AsyncLLMEngine.from_pretrained(str(tmp_path), batch_timeout="soon")


def test_generate_gives_the_final_outputs_in_the_order_of_the_prompts(engine):
    async def run():
        several = await engine.generate(PROMPTS, max_tokens=6, temperature=0, ignore_eos=True)
        one = await engine.generate(PROMPTS[1], max_tokens=6, temperature=0, ignore_eos=True)
        return several, one

    several, one = asyncio.run(run())
    assert [o.prompt for o in several] == PROMPTS
    assert all(o.finished and len(o.outputs[0].token_ids) == 6 for o in several)
    assert [o.request_id.rsplit("-", 1)[1] for o in several] == ["0", "1", "2"]
    assert len(one) == 1 and one[0].outputs[0].token_ids == several[1].outputs[0].token_ids


def test_a_stream_yields_each_new_piece_once_interleaved_across_prompts(engine):
    async def run():
        final = await engine.generate(PROMPTS, max_tokens=8, temperature=0, ignore_eos=True)
        stream = await engine.generate(
            PROMPTS, stream=True, max_tokens=8, temperature=0, ignore_eos=True
        )
        return final, [output async for output in stream]

    final, deltas = asyncio.run(run())
    by_prompt: dict[int, list] = {}
    for output in deltas:
        by_prompt.setdefault(int(output.request_id.rsplit("-", 1)[1]), []).append(output)
    assert sorted(by_prompt) == [0, 1, 2]
    for i, outputs in by_prompt.items():
        assert "".join(o.outputs[0].text for o in outputs) == final[i].outputs[0].text
        ids = [t for o in outputs for t in o.outputs[0].token_ids]
        assert ids == final[i].outputs[0].token_ids
        assert all(o.outputs[0].token_ids for o in outputs)  # nothing empty is yielded
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].outputs[0].finish_reason == "length"
        assert outputs[0].prompt == PROMPTS[i]
    assert max(len(v) for v in by_prompt.values()) > 1  # it did stream


def test_sampling_params_and_keywords_combine_and_each_sample_streams_its_own_delta(engine):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=3)

    async def run():
        final = await engine.generate(PROMPTS[0], params, max_tokens=5, ignore_eos=True)
        stream = await engine.generate(PROMPTS[0], params, stream=True, max_tokens=5)
        return final, [o async for o in stream]

    [final], deltas = asyncio.run(run())
    assert len(final.outputs) == 2 and all(len(c.token_ids) == 5 for c in final.outputs)
    for index in (0, 1):
        ids = [t for o in deltas for c in o.outputs if c.index == index for t in c.token_ids]
        assert ids == final.outputs[index].token_ids
    assert params.max_tokens == 3  # the caller's params are left as they were


def test_an_unknown_keyword_is_named(engine):
    with pytest.raises(TypeError, match="max_new_tokens"):
        engine.generate(PROMPTS, max_new_tokens=5)
    with pytest.raises(TypeError, match="takes a SamplingParams"):
        engine.generate(PROMPTS[0], None, "rid")


def test_bad_input_raises_from_the_call_and_aborts_the_others(engine):
    too_long = " ".join(f"t{i}" for i in range(3, 200))

    async def run():
        with pytest.raises(ValueError, match="prompt"):
            await engine.generate([PROMPTS[0], too_long], max_tokens=50, ignore_eos=True)
        stream = await engine.generate([PROMPTS[0], too_long], stream=True, max_tokens=50)
        with pytest.raises(ValueError, match="prompt"):
            async for _ in stream:
                pass
        return await _idle(engine)

    stats = asyncio.run(run())
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0


def test_leaving_a_stream_early_aborts_every_prompts_request(engine):
    async def run():
        steps_before = engine.num_steps
        stream = await engine.generate(PROMPTS, stream=True, max_tokens=120, ignore_eos=True)
        async for _ in stream:
            break
        await stream.aclose()
        stats = await _idle(engine)
        return engine.num_steps - steps_before, stats, engine.num_requests

    num_steps, stats, open_streams = asyncio.run(run())
    assert num_steps < 60  # a step a token: none ran to its 120 tokens
    assert stats["num_running"] == stats["num_waiting"] == 0 and open_streams == 0


def test_the_request_id_form_is_async_engines_cumulative_stream(engine):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        plain = [o async for o in engine.generate(PROMPTS[0], params, "plain")]
        tenant = [o async for o in engine.generate(PROMPTS[0], params, "t", tenant_id="x")]
        return plain, tenant

    plain, tenant = asyncio.run(run())
    for outputs in (plain, tenant):
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
        ids = [o.outputs[0].token_ids for o in outputs]
        assert all(ids[-1][: len(earlier)] == earlier for earlier in ids)  # cumulative
    assert tenant[-1].outputs[0].token_ids == plain[-1].outputs[0].token_ids
    assert RequestOutputKind.CUMULATIVE == params.output_kind
