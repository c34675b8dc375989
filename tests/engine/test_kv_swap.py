"""swap_space end to end on CPU (tiny-llama, dummy weights): preemption by swapping gives the
tokens recomputing and no preemption give, leaks nothing (aborts while swapped out included),
and the prefix cache's CPU tier serves an evicted prompt again, one tenant at a time. Also
the copies of engine/worker/kv_swap.py against block-by-block indexing (on a GPU:
tests/gpu/test_kv_swap_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.observability.metrics import PrometheusSink
from engine.worker.kv_swap import KVSwapSpace, _copy_runs, _runs

TINY = dict(model="tiny-llama", load_format="dummy", max_model_len=256, block_size=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# Six prompts of 30 to 55 tokens and 40 outputs: 39 usable blocks of 4 hold about two.
PROMPTS = [[(i * 7 + j) % 500 + 3 for j in range(30 + i * 5)] for i in range(6)]
SWAP = dict(swap_space=0.01, preemption_mode="swap")


def _check_all_free(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    kv, offload = scheduler.kv_cache_manager, scheduler.offload
    kv.check_invariants()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
    if offload is not None:
        offload.check_invariants()
        assert not offload.swapped and not offload.pool.swapped
        assert offload.pool.num_free + len(offload.pool.tier) == offload.pool.num_blocks


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def unpreempted() -> list[list[int]]:
    llm = LLM(**TINY, num_gpu_blocks=400)
    tokens = _tokens(llm)
    assert llm.engine.stats()["num_preemptions"] == 0
    return tokens


@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
def test_preempting_by_swap_or_recompute_gives_the_unpreempted_tokens(unpreempted, mode):
    llm = LLM(**TINY, num_gpu_blocks=40, swap_space=0.01, preemption_mode=mode)
    sink = PrometheusSink()
    llm.engine.enable_metrics(sink, flush_interval_s=0.0)
    assert _tokens(llm) == unpreempted
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    swap_outs = sink.registry.get_sample_value("kvray_num_swap_outs_total", {"model": "tiny-llama"})
    # auto follows the costs this machine measured: on a CPU either way, so it is only
    # held to its threshold here (tests/unit/test_kv_offload.py holds it to the model).
    threshold = llm.engine.scheduler.offload.swap_threshold_tokens
    if mode == "recompute" or (mode == "auto" and threshold is None):
        assert stats["num_swap_outs"] == 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0
    assert stats["num_swap_ins"] == stats["num_swap_outs"] == (swap_outs or 0)
    _check_all_free(llm)


def test_a_request_aborted_while_swapped_out_leaves_no_block_behind(unpreempted):
    llm = LLM(**TINY, num_gpu_blocks=40, **SWAP)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    swapped_seen = 0
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        swapped = engine.scheduler.offload.swapped
        swapped_seen = max(swapped_seen, engine.stats()["num_swapped"])
        if swapped and "aborted" not in done:
            victim = swapped[0].request_id
            engine.abort_request([victim])
            assert engine.scheduler.requests.get(victim) is None
            done["aborted"] = victim
    assert swapped_seen > 0
    aborted = done.pop("aborted")
    assert {int(rid): t for rid, t in done.items()} == {
        i: t for i, t in enumerate(unpreempted) if str(i) != aborted
    }
    _check_all_free(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forked_samples_swapped_out_and_back_draw_what_they_draw_unpreempted(prefix_caching):
    """n > 1 samples share their prompt's blocks (forks); swapping one out copies the shared
    blocks and brings it back with blocks of its own, and the seeded draws do not change."""
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)

    def draws(llm: LLM) -> list[list[list[int]]]:
        outs = llm.generate(PROMPTS[3:], sampled)
        return [[c.token_ids for c in out.outputs] for out in outs]

    keys = dict(TINY, enable_prefix_caching=prefix_caching)
    reference = draws(LLM(**keys, num_gpu_blocks=400))
    llm = LLM(**keys, num_gpu_blocks=40, **SWAP)
    assert draws(llm) == reference
    assert llm.engine.stats()["num_swap_outs"] > 0
    _check_all_free(llm)


def test_beam_searches_under_swap_pressure_find_the_unpreempted_beams():
    from engine.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True)

    def beams(llm: LLM) -> list[list[list[int]]]:
        return [[b.tokens for b in out.sequences] for out in llm.beam_search(PROMPTS, params)]

    reference = beams(LLM(**TINY, num_gpu_blocks=400))
    llm = LLM(**TINY, num_gpu_blocks=60, **SWAP)
    assert beams(llm) == reference
    assert llm.engine.stats()["num_swap_outs"] > 0
    _check_all_free(llm)


def _run_one(engine, request_id: str, prompt: list[int], cache_salt: str | None = None):
    engine.add_request(request_id, prompt, GREEDY, cache_salt=cache_salt)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def test_an_evicted_prompt_is_served_from_the_cpu_tier_but_not_to_another_tenant():
    llm = LLM(**TINY, num_gpu_blocks=24, swap_space=0.01)
    engine = llm.engine
    prompt = PROMPTS[5]  # 55 tokens: 13 full blocks
    first = _run_one(engine, "first", prompt, cache_salt="tenant-a")
    # Other prompts take every GPU block in turn: the first one's blocks go to the CPU tier.
    _tokens(llm, PROMPTS[:3])
    on_gpu = engine.scheduler.kv_cache_manager.get_computed_blocks(
        Request("probe", prompt, GREEDY, cache_salt="tenant-a")
    )[1]
    assert on_gpu < 52
    before = engine.stats()
    again = _run_one(engine, "again", prompt, cache_salt="tenant-a")
    after = engine.stats()
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Every full block but the one holding the last token, whose logits sample: the step
    # computes only the uncached tail.
    assert again.num_cached_tokens == 52
    assert after["cpu_prefix_cache_hits"] - before["cpu_prefix_cache_hits"] == 52 - on_gpu
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 52
    # The same prompt under another tenant's cache salt: no hit on either tier.
    other = _run_one(engine, "other", prompt, cache_salt="tenant-b")
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.stats()["cpu_prefix_cache_hits"] == after["cpu_prefix_cache_hits"]
    _check_all_free(llm)


def test_without_swap_space_there_is_no_pool_and_no_copy():
    llm = LLM(**TINY, num_gpu_blocks=40)
    assert llm.engine.scheduler.offload is None
    assert llm.engine.executor.worker.runner.kv_swap is None
    assert llm.engine.scheduler.kv_cache_manager.block_pool.evict_listener is None
    assert "num_swap_outs" not in llm.engine.stats()


def _reference_apply(gpu, cpu, copies_out, copies_in):
    """Reads before writes, one block at a time."""
    staged = [(g, cpu[:, c].clone()) for c, g in copies_in]
    for g, c in copies_out:
        cpu[:, c] = gpu[:, g]
    for g, block in staged:
        gpu[:, g] = block


def _check_copies(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (2, 12, 4, 2, 8)
    gpu = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(3)]
    space = KVSwapSpace(gpu, num_cpu_blocks=9)
    for cpu in space.cpu_caches:
        cpu.copy_(torch.randint(0, 255, cpu.shape, generator=gen, dtype=torch.uint8))
    expected_gpu = [g.view(torch.uint8).cpu().clone() for g in gpu]
    expected_cpu = [c.clone() for c in space.cpu_caches]
    # Block 3 of the pool is read and written in one step; gpu block 5 likewise.
    copies_out = [(5, 3), (7, 4), (2, 8), (9, 0)]
    copies_in = [(3, 5), (6, 1), (7, 11)]
    for g, c in zip(expected_gpu, expected_cpu, strict=True):
        _reference_apply(g, c, copies_out, copies_in)
    space.apply(copies_out, copies_in)
    space.synchronize()
    torch.cuda.synchronize() if device == "cuda" else None
    for g, want in zip(gpu, expected_gpu, strict=True):
        assert torch.equal(g.view(torch.uint8).cpu(), want)
    for c, want in zip(space.cpu_caches, expected_cpu, strict=True):
        assert torch.equal(c, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_swap_copies_match_block_by_block_indexing_on_cpu(dtype):
    _check_copies("cpu", dtype)


def test_pool_blocks_are_copied_in_runs():
    assert _runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (5, 3, 2), (9, 5, 1)]
    assert _runs([]) == []
    # The CUDA path's copies: run by run, both halves (keys, values).
    src = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    dst = torch.zeros(2, 10, 3, dtype=src.dtype)
    _copy_runs(dst, src, _runs([4, 5, 7]))  # (pool id, position, length): pool <- staged
    assert torch.equal(dst[:, [4, 5, 7]], src[:, :3]) and dst[:, [0, 1, 2, 3, 6, 8, 9]].eq(0).all()


def test_a_seeded_request_swapped_out_midway_samples_what_it_samples_running_through():
    llm = LLM(**(TINY | dict(max_model_len=128, num_gpu_blocks=24)), **SWAP)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=40, ignore_eos=True)
    prompt = list(range(1, 9))
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    # It arrives last, so it is the first the scheduler preempts: by swapping.
    fillers = [[i + 20] * 8 for i in range(3)]
    crowded = llm.generate([*fillers, prompt], [GREEDY] * 3 + [seeded])
    assert llm.engine.stats()["num_swap_outs"] > 0
    assert crowded[-1].outputs[0].token_ids == alone
    _check_all_free(llm)
