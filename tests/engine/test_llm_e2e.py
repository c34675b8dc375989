"""kvray's greedy output on the bundled SmolLM2 equals transformers' token for token."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, RequestOutputKind, SamplingParams
from tests.support.prompts import LONG_TEXT, PROMPTS
from tests.support.steps_in_flight import record_steps_in_flight

MAX_NEW_TOKENS = 64

SHARED_PREFIX = LONG_TEXT[:900]
PREFIX_PROMPTS = [SHARED_PREFIX + q for q in (" Who kept the records?", " What was recorded?")]


def _hf_greedy(hf, prompts: list[str]) -> list[list[int]]:
    tok, model = hf
    outs = []
    for prompt in prompts:
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.inference_mode():
            gen = model.generate(
                ids,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                pad_token_id=tok.eos_token_id,
            )
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


@pytest.fixture(scope="module")
def hf_reference(hf) -> list[list[int]]:
    return _hf_greedy(hf, PROMPTS)


@pytest.fixture(scope="module")
def hf_prefix_reference(hf) -> list[list[int]]:
    return _hf_greedy(hf, PREFIX_PROMPTS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        # HF stops at EOS; kvray does too (and reports finish_reason "stop").
        assert g == w, f"prompt {i}: first difference at token {_first_diff(g, w)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def test_long_prompt_is_long(hf):
    tok, _ = hf
    assert len(tok(PROMPTS[-1], add_special_tokens=False).input_ids) > 500


def test_greedy_matches_transformers(hf_reference, bundled_llm):
    llm = bundled_llm
    outputs = llm.generate(PROMPTS, GREEDY)
    _assert_same(_token_ids(outputs), hf_reference)
    tok = llm.get_tokenizer()
    for out in outputs:
        completion = out.outputs[0]
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == MAX_NEW_TOKENS


def test_chunked_prefill_keeps_outputs(hf_reference):
    llm = LLM(max_num_batched_tokens=32, max_num_seqs=8)
    _assert_same(_token_ids(llm.generate(PROMPTS, GREEDY)), hf_reference)


def test_prompts_chunked_beside_decodes_keep_outputs(hf_reference):
    # Two at a time: each later prompt is admitted while the other request decodes, and
    # is prefilled 24 tokens a step beside it.
    llm = LLM(max_num_seqs=2, max_prefill_tokens_with_decodes=24)
    _assert_same(_token_ids(llm.generate(PROMPTS, GREEDY)), hf_reference)


def test_prefix_caching_keeps_outputs_and_hits(hf_prefix_reference):
    llm = LLM(enable_prefix_caching=True)
    first = llm.generate(PREFIX_PROMPTS[:1], GREEDY)
    assert llm.engine.stats()["prefix_cache_hits"] == 0
    second = llm.generate(PREFIX_PROMPTS[1:], GREEDY)
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    assert second[0].num_cached_tokens >= 16
    _assert_same(_token_ids(first + second), hf_prefix_reference)


def test_preemption_keeps_outputs(hf_reference):
    # 59 usable blocks of 16 tokens cannot hold the whole batch: requests get preempted.
    llm = LLM(num_gpu_blocks=60, enable_prefix_caching=False)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats()["num_preemptions"] > 0
    _assert_same(_token_ids(outputs), hf_reference)
    assert llm.engine.stats()["kv_cache_usage"] == 0


def test_bad_input_is_a_clear_error():
    llm = LLM(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["word " * 100], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**7]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    # The engine still serves after rejecting bad requests.
    assert llm.generate(["Hello"], SamplingParams(max_tokens=4))[0].outputs[0].token_ids

    # A prompt over max_model_len fits once truncated to its last tokens.
    ids = llm.get_tokenizer().encode("word " * 100, add_special_tokens=False)
    for keep, kept in ((10, 10), (-1, 63)):
        params = SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=keep)
        (out,) = llm.generate([ids], params)
        assert out.prompt_token_ids == ids[-kept:]
        (direct,) = llm.generate([ids[-kept:]], SamplingParams(temperature=0.0, max_tokens=1))
        assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\) must be <= max_model_len"):
        llm.generate([ids], SamplingParams(max_tokens=1, truncate_prompt_tokens=65))


def test_missing_weights_file_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        LLM(model=str(missing))


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["FancyNewForCausalLM"], "model_type": "llama", "vocab_size": 32,'
        ' "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,'
        ' "intermediate_size": 32}'
    )
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(model=str(tmp_path), load_format="dummy")


def test_stop_strings_and_n_and_chat(bundled_llm):
    llm = bundled_llm
    params = SamplingParams(temperature=0.0, max_tokens=32)
    base = llm.generate(["The three primary colors are"], params)[0].outputs[0]
    words = base.text.split()
    assert len(words) > 3
    stop = words[2]
    stopped = llm.generate(
        ["The three primary colors are"],
        SamplingParams(temperature=0.0, max_tokens=32, stop=[stop]),
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stop not in stopped.text and base.text.startswith(stopped.text)

    sampled = llm.generate(
        ["Tell me a story."], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    )[0]
    assert [o.index for o in sampled.outputs] == [0, 1, 2]
    again = llm.generate(
        ["Tell me a story."], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    )[0]
    assert [o.token_ids for o in sampled.outputs] == [o.token_ids for o in again.outputs]

    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=8))
    assert chat[0].outputs[0].token_ids
    begun = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi! I am"}]
    (continued,) = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)
    assert llm.get_tokenizer().decode(continued.prompt_token_ids).endswith("assistant\nHi! I am")


def test_overlapped_steps_match_synchronous_steps():
    """Scheduling step t+1 while step t runs changes no output, also with stops, n > 1,
    penalties (which count the token still in flight on the device) and chunked prefill."""
    llm = LLM(max_num_batched_tokens=48)
    prompts = PROMPTS[:6]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=20, stop=["."]),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3),
        # Strong enough that counting the previous token or not changes the greedy choice.
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=2.0),
    ]
    assert llm.engine.executor.supports_overlap
    in_flight_at_launch = record_steps_in_flight(llm.engine)
    overlapped = llm.generate(prompts, params)
    assert sum(in_flight_at_launch) >= len(in_flight_at_launch) - 2  # penalties overlap too
    llm.engine.executor.supports_overlap = False
    synchronous = llm.generate(prompts, params)
    for a, b in zip(overlapped, synchronous, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
    assert len(overlapped[0].outputs[0].token_ids) == 12
    assert llm.engine.stats()["kv_cache_usage"] == 0


def test_min_tokens_holds_stops_back_and_keeps_steps_overlapped():
    llm = LLM()
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24))
    tokens = free[0].outputs[0].token_ids
    # A stop token the model emits early: min_tokens must hold it back.
    stop_id = tokens[1]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=8, stop_token_ids=[stop_id])
    assert not params.reads_token_history
    engine = llm.engine
    in_flight_at_launch = record_steps_in_flight(engine)
    held = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert max(in_flight_at_launch) == 1  # the overlap stayed on
    assert len(held.token_ids) >= 8 and stop_id not in held.token_ids[:8]
    # Greedy tokens are the free run's until its first stop id, which is held back.
    first = tokens.index(stop_id)
    assert held.token_ids[:first] == tokens[:first]
    if held.finish_reason == "stop":
        assert held.token_ids[-1] == stop_id and stop_id not in held.token_ids[8:-1]
    engine.executor.supports_overlap = False
    assert llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids == held.token_ids


def test_final_only_requests_give_one_output_and_cumulative_ones_one_per_step(bundled_llm):
    llm = bundled_llm
    engine = llm.engine
    final = SamplingParams(temperature=0.0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
    steps = dataclasses.replace(final, output_kind=RequestOutputKind.CUMULATIVE)
    engine.add_request("final", PROMPTS[0], final)
    engine.add_request("steps", PROMPTS[0], steps)
    seen: dict[str, list] = {"final": [], "steps": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert [o.finished for o in seen["final"]] == [True]
    assert [len(o.outputs[0].token_ids) for o in seen["steps"]] == [1, 2, 3, 4, 5, 6]
    assert seen["final"][0].outputs[0].token_ids == seen["steps"][-1].outputs[0].token_ids
    assert seen["final"][0].outputs[0].text == seen["steps"][-1].outputs[0].text


def test_warm_up_leaves_no_state_behind():
    # Engines on a GPU run warm_up() at start; a user's first request must not see it.
    llm = LLM()
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids
    engine.scheduler.kv_cache_manager.reset_prefix_cache()
    engine.warm_up()
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_cache_usage"] == 0.0
    assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0
    assert not engine.has_unfinished_requests()
    token = min(engine.vocab_size - 1, 100)
    out = llm.generate([[token] * 40], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.num_cached_tokens == 0  # the warm-up's prompt left no cached blocks
    assert llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids == before


@pytest.fixture(scope="module")
def warm_up_steps():
    """(engine, [(num_decodes, max_query_len)] of each step its warm_up() ran, the kind of
    each step's sampling: "greedy", "random" or "mixed")."""
    import engine.worker.model_runner as model_runner

    engine = LLM(max_model_len=256).engine
    runner = engine.executor.worker.runner
    steps, sampled = [], []
    prepare, sample = runner.prepare_inputs, model_runner.sample_on_device

    def spy(out):
        inputs = prepare(out)
        steps.append((inputs.attn_metadata.num_decodes, inputs.attn_metadata.max_query_len))
        return inputs

    def sampling_spy(logits, batch):
        mixed = "mixed" if batch.greedy is not None else "random"
        sampled.append("greedy" if batch.all_greedy else mixed)
        return sample(logits, batch)

    runner.prepare_inputs, model_runner.sample_on_device = spy, sampling_spy
    try:
        engine.warm_up()
    finally:
        runner.prepare_inputs, model_runner.sample_on_device = prepare, sample
    return engine, steps, sampled


def test_warm_up_runs_a_batch_that_mixes_a_decode_with_a_prefill(warm_up_steps):
    # A GPU launches a kernel variant for the decodes of a mixed batch that Triton must
    # compile before the first user's batch, not in it.
    _, steps, _ = warm_up_steps
    assert any(decodes >= 1 and longest > 1 for decodes, longest in steps), steps


def test_warm_up_samples_greedily_at_random_and_both_in_one_step(warm_up_steps):
    # The GPU's sampling kernel has a variant for each: a user's first batch of one kind
    # would otherwise wait for its compile.
    _, _, sampled = warm_up_steps
    assert set(sampled) == {"greedy", "random", "mixed"}, sampled


def test_warm_up_runs_a_prefill_of_every_attention_tile_size(warm_up_steps):
    # The prefill kernel's tile follows the batch's longest query; each tile size is a
    # Triton compile a user's short prompt would otherwise wait for.
    from kernels.triton_attention import prefill_block_m

    engine, steps, _ = warm_up_steps
    hf = engine.hf_config
    group = hf.num_attention_heads // hf.num_key_value_heads
    float32 = engine.config.model.dtype == "float32"
    reachable = {prefill_block_m(n, group, float32) for n in range(2, 256)}
    assert {prefill_block_m(n, group, float32) for _, n in steps if n > 1} == reachable


def test_warm_up_fits_a_short_max_model_len():
    engine = LLM(max_model_len=20).engine
    engine.warm_up()
    assert not engine.has_unfinished_requests()


def test_logit_bias_steers_generation_and_refuses_ids_outside_the_vocabulary():
    llm = LLM(max_model_len=256)
    token = 1234
    params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={token: 100})
    for out in llm.generate(PROMPTS[:2], params):
        assert out.outputs[0].token_ids == [token] * 5
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is out of range"):
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match=f"allowed_token_ids token id {vocab} is out of range"):
        llm.generate(PROMPTS[:1], SamplingParams(allowed_token_ids=[5, vocab]))
    assert not llm.engine.has_unfinished_requests()
    # allowed_token_ids: sampled at random, only those tokens come out.
    allowed = [1234, 2000, 4321, 7]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, allowed_token_ids=allowed)
    for out in llm.generate(PROMPTS[:2], params):
        assert set(out.outputs[0].token_ids) <= set(allowed)


def test_a_seeded_request_preempted_midway_samples_what_it_samples_running_through():
    llm = LLM("tiny-llama", load_format="dummy", max_model_len=128, num_gpu_blocks=24,
              block_size=4, enable_prefix_caching=False)  # fmt: skip
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=40, ignore_eos=True)
    prompt = list(range(1, 9))
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    before = llm.engine.stats()["num_preemptions"]
    # The seeded request arrives last, so it is the first the scheduler preempts.
    fillers = [[i + 20] * 8 for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    crowded = llm.generate([*fillers, prompt], [greedy] * 3 + [seeded])
    assert llm.engine.stats()["num_preemptions"] > before
    assert crowded[-1].outputs[0].token_ids == alone
