"""Beam searches over the scheduler with a fake model: the beams fork one another's blocks
(the fake runner checks every KV slot it reads), wait for each other when a step's budget
splits them, survive preemption, and choose what BeamGroup alone chooses."""

from __future__ import annotations

import math
import random

import pytest

from engine.beam_search import BeamSearches
from engine.core.beam_group import BeamGroup, BeamOffer
from engine.core.scheduler_output import ModelRunnerOutput
from engine.input_processor import InputProcessor
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputs
from tests.unit.test_scheduler import FakeRunner, make_scheduler

VOCAB = 12
EOS = 2


def distribution(token_ids: list[int]) -> list[tuple[int, float]]:
    """A fake model's next-token logprobs for a context, most likely first."""
    rng = random.Random(hash(tuple(token_ids)))
    weights = [rng.random() ** 3 for _ in range(VOCAB)]
    total = sum(weights)
    return sorted(((t, math.log(w / total)) for t, w in enumerate(weights)), key=lambda x: -x[1])


class LogprobRunner(FakeRunner):
    def __init__(self, num_logprobs: int):
        super().__init__(lambda req_id, ids: distribution(ids)[0][0])
        self.num_logprobs = num_logprobs

    def execute(self, out):
        result = super().execute(out)
        logprobs = {}
        for req_id, token in result.sampled_token_ids.items():
            top = distribution(self.states[req_id].token_ids)[: self.num_logprobs]
            logprobs[req_id] = TokenLogprobs(token, top[0][1], 1, dict(top))
        return ModelRunnerOutput(result.sampled_token_ids, logprobs)


def reference(prompt: list[int], width: int, max_tokens: int, **kw) -> BeamGroup:
    group = BeamGroup(width, max_tokens, frozenset({EOS}), **kw)
    beams = [([], 0.0)]
    while not group.done:
        offers = [
            BeamOffer(tokens, cum, distribution(prompt + tokens)[: group.num_candidates])
            for tokens, cum in beams
        ]
        chosen = group.select(offers)
        beams = [([*beams[c.parent][0], c.token_id], c.cum_logprob) for c in chosen]
    return group


def make_searches(scheduler) -> BeamSearches:
    processor = InputProcessor(
        None,
        VOCAB,
        scheduler.max_model_len,
        eos_token_id=EOS,
        runner_eos_token_id=EOS,
        more_eos_token_ids=[],
        check_prompt_len=scheduler.check_prompt_len,
        structured=StructuredOutputs(None, VOCAB, EOS),
    )
    return BeamSearches(scheduler, processor, None, [EOS])


@pytest.mark.parametrize(
    ("num_blocks", "max_num_seqs", "enable_prefix_caching"),
    [(65, 16, False), (65, 16, True), (65, 3, False), (14, 16, False), (12, 5, True)],
)
def test_beam_searches_choose_what_beam_group_chooses(
    num_blocks, max_num_seqs, enable_prefix_caching
):
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16,
        max_model_len=40,
        enable_prefix_caching=enable_prefix_caching,
    )
    searches = make_searches(scheduler)
    runner = LogprobRunner(8)
    rng = random.Random(num_blocks * max_num_seqs)
    specs = {}
    for i in range(4):
        prompt = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(3, 9))]
        width = rng.choice([2, 3, 4])
        early = rng.choice([True, False, "never"])
        params = SamplingParams(
            n=width, use_beam_search=True, max_tokens=12, early_stopping=early, length_penalty=1.2
        )
        searches.add(f"s{i}", prompt, params)
        specs[f"s{i}"] = (prompt, width, early)
    finals = {}
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        runner_output = runner.execute(out)
        updated = scheduler.update_from_output(out, runner_output)
        for output in searches.process(updated, runner_output):
            finals[output.request_id] = output
        # A search's beams may outnumber max_num_seqs in the running queue (they wait
        # there for one another, holding their blocks); a step never runs more.
        assert len(out.num_scheduled_tokens) <= max_num_seqs
        scheduler.kv_cache_manager.check_invariants()
    assert set(finals) == set(specs) and not searches.active
    assert scheduler.kv_cache_manager.usage == 0
    for rid, (prompt, width, early) in specs.items():
        group = reference(prompt, width, 12, early_stopping=early, length_penalty=1.2)
        got = finals[rid].outputs
        assert [o.token_ids for o in got] == [h.token_ids for h in group.finished]
        assert [o.cumulative_logprob for o in got] == pytest.approx(
            [h.cum_logprob for h in group.finished]
        )
    if num_blocks < 20:
        assert scheduler.num_preemptions > 0


def test_aborting_a_search_finishes_its_beams():
    scheduler = make_scheduler(enable_prefix_caching=False)
    searches = make_searches(scheduler)
    runner = LogprobRunner(6)
    searches.add("s", [5, 6, 7], SamplingParams(n=3, use_beam_search=True, max_tokens=10))
    for _ in range(3):
        out = scheduler.schedule()
        ro = runner.execute(out)
        searches.process(scheduler.update_from_output(out, ro), ro)
    assert scheduler.kv_cache_manager.num_shared_blocks() > 0
    assert searches.abort(["s", "unknown"]) == ["s"]
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_manager.usage == 0
