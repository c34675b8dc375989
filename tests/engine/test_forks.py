"""Forked samples on the bundled model: n > 1 shares the prompt's KV blocks (copy-on-write
of the last, partial one) and samples what separate requests with the same seeds sample."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import RequestStatus
from engine.worker.block_copy import copy_blocks, copy_blocks_ref

PROMPT = (
    "The history of the city begins with a small settlement on the river, where traders met every"
)
SEED = 11
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llm_without_prefix_caching():
    return LLM(enable_prefix_caching=False)


def _separate(llm: LLM, n: int) -> list[list[int]]:
    params = [
        SamplingParams(temperature=1.0, seed=SEED + i, max_tokens=MAX_TOKENS) for i in range(n)
    ]
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * n, params)]


def _run(llm: LLM, request_id: str, n: int, abort_after: int | None = None):
    """Step the request to its end; (its output, the most blocks in use at once, the
    block copies the steps carried). `abort_after`: steps before sample #1 is aborted."""
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    copies = []
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        out = schedule(*args, **kwargs)
        copies.extend(out.blocks_to_copy)
        return out

    engine.scheduler.schedule = spy
    try:
        params = SamplingParams(n=n, temperature=1.0, seed=SEED, max_tokens=MAX_TOKENS)
        engine.add_request(request_id, PROMPT, params)
        used, final, steps = 0, None, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                final = output
            steps += 1
            if steps == abort_after:
                engine.scheduler.finish_requests(f"{request_id}#1", RequestStatus.FINISHED_ABORTED)
            kv.check_invariants()
            used = max(used, kv.block_pool.num_usable_blocks - kv.num_free_blocks)
    finally:
        engine.scheduler.schedule = schedule
    assert kv.usage == 0
    return final, used, copies


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_samples_fork_the_prompt_blocks_and_equal_separate_seeded_requests(
    prefix_caching, llm_without_prefix_caching, bundled_llm
):
    llm = bundled_llm if prefix_caching else llm_without_prefix_caching
    kv = llm.engine.scheduler.kv_cache_manager
    bs = kv.block_size
    num_prompt = len(llm.engine.encode(PROMPT))
    assert (num_prompt - 1) % bs, "the last prompt token must share a block with others"
    out, used, copies = _run(llm, f"fork-{prefix_caching}", 4)
    # The blocks before the last prompt token's are held once; each fork copies that block
    # and grows its own from there.
    num_shared = (num_prompt - 1) // bs
    per_sample = -(-(num_prompt + MAX_TOKENS - 1) // bs)
    assert used == num_shared + 4 * (per_sample - num_shared) < 4 * per_sample
    assert len(copies) == 3
    assert [o.token_ids for o in out.outputs] == _separate(llm, 4)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]


def test_aborting_one_sample_leaves_the_others_as_they_were(llm_without_prefix_caching):
    llm = llm_without_prefix_caching
    out, _, _ = _run(llm, "abort-one", 3, abort_after=3)
    assert out.outputs[1].finish_reason == "abort"
    assert len(out.outputs[1].token_ids) < MAX_TOKENS
    want = _separate(llm, 3)
    assert out.outputs[0].token_ids == want[0] and out.outputs[2].token_ids == want[2]
    assert out.outputs[1].token_ids == want[1][: len(out.outputs[1].token_ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_block_copy_matches_the_reference(dtype):
    caches = [torch.randn(2, 9, 4, 2, 8).to(dtype) for _ in range(3)]
    expected = [c.clone() for c in caches]
    pairs = [(1, 5), (3, 2), (1, 7)]
    copy_blocks(caches, pairs)
    copy_blocks_ref(expected, pairs)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(caches[0][:, 5].float(), caches[0][:, 1].float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_block_copy_on_cuda_matches_the_reference(dtype):
    caches = [torch.randn(2, 33, 16, 4, 64, device="cuda").to(dtype) for _ in range(4)]
    expected = [c.cpu() for c in caches]
    pairs = [(i, 32 - i) for i in range(1, 12)]
    copy_blocks(caches, pairs)
    copy_blocks_ref(expected, pairs)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_beams_fork_each_other_and_free_what_they_leave(llm_without_prefix_caching, bundled_llm):
    from engine.beam_search import BeamSearchParams

    llm = llm_without_prefix_caching
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS).to_sampling_params()
    engine.add_request("beams", PROMPT, params)
    shared, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
        kv.check_invariants()
        shared.append(kv.num_shared_blocks())
    assert kv.usage == 0
    # The prompt's full block is computed once and held by every beam.
    num_prompt = len(engine.encode(PROMPT))
    assert max(shared) >= num_prompt // kv.block_size >= 1
    # With prefix caching on, the same search.
    (cached,) = bundled_llm.generate(PROMPT, params)
    assert [o.token_ids for o in final.outputs] == [o.token_ids for o in cached.outputs]
    assert len(final.outputs) == 4 and final.finished


def test_aborting_a_beam_search_frees_every_beam(llm_without_prefix_caching):
    engine = llm_without_prefix_caching.engine
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=MAX_TOKENS)
    engine.add_request("beams-aborted", PROMPT, params)
    for _ in range(3):
        assert not engine.step()
    engine.abort_request(["beams-aborted"])
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.scheduler.kv_cache_manager
    kv.check_invariants()
    assert kv.usage == 0 and not engine.beam_searches.searches
