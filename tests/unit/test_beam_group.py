"""BeamGroup: the choices of one beam search step by step, as transformers makes them."""

from __future__ import annotations

import math

import pytest

from engine.core.beam_group import BeamGroup, BeamOffer

EOS = 0


def lp(p: float) -> float:
    return math.log(p)


def offer(tokens: list[int], cum: float, nexts: dict[int, float]) -> BeamOffer:
    return BeamOffer(tokens, cum, [(t, lp(p)) for t, p in nexts.items()])


def test_first_step_keeps_the_w_best_tokens_and_ranks_the_next_over_all_beams():
    group = BeamGroup(2, max_tokens=5, eos_token_ids=frozenset({EOS}))
    (first,) = [offer([], 0.0, {5: 0.5, 6: 0.3, 7: 0.1, 8: 0.05})]
    chosen = group.select([first])
    assert [(c.parent, c.token_id) for c in chosen] == [(0, 5), (0, 6)]
    assert chosen[0].cum_logprob == pytest.approx(lp(0.5))
    # Next step: beam 1's best continuation beats beam 0's second best.
    beams = [
        offer([5], lp(0.5), {9: 0.4, 10: 0.2, 11: 0.1, 12: 0.1}),
        offer([6], lp(0.3), {13: 0.9, 14: 0.05, 15: 0.01, 16: 0.01}),
    ]
    chosen = group.select(beams)
    assert [(c.parent, c.token_id) for c in chosen] == [(1, 13), (0, 9)]
    assert group.num_generated == 2 and not group.done


def test_eos_finishes_a_hypothesis_only_among_the_w_best_and_scores_it_by_generated_length():
    group = BeamGroup(2, max_tokens=8, eos_token_ids=frozenset({EOS}), length_penalty=1.0)
    group.select([offer([], 0.0, {5: 0.6, 6: 0.3, 7: 0.05, 8: 0.05})])
    beams = [
        # EOS ranks first: finished, length 2 (the EOS counted).
        offer([5], lp(0.6), {EOS: 0.7, 9: 0.2, 10: 0.05, 11: 0.05}),
        # EOS of the second beam ranks past W: dropped.
        offer([6], lp(0.3), {12: 0.5, EOS: 0.2, 13: 0.2, 14: 0.1}),
    ]
    chosen = group.select(beams)
    assert [(c.parent, c.token_id) for c in chosen] == [(1, 12), (0, 9)]
    (finished,) = group.finished
    assert finished.token_ids == [5, EOS] and finished.ended_by_eos
    assert finished.cum_logprob == pytest.approx(lp(0.6) + lp(0.7))
    assert finished.score == pytest.approx((lp(0.6) + lp(0.7)) / 2)


def test_the_length_limit_finishes_the_w_best_and_ends_the_search():
    group = BeamGroup(2, max_tokens=2, eos_token_ids=frozenset({EOS}), length_penalty=0.0)
    group.select([offer([], 0.0, {5: 0.6, 6: 0.4, 7: 0.0001, 8: 0.0001})])
    beams = [offer([5], lp(0.6), {9: 0.5, 10: 0.5}), offer([6], lp(0.4), {11: 0.9, 12: 0.1})]
    assert group.select(beams) == [] and group.done
    assert [h.token_ids for h in group.finished] == [[6, 11], [5, 9]]
    assert not any(h.ended_by_eos for h in group.finished)


def _two_finished_then(early_stopping, length_penalty: float) -> BeamGroup:
    """A search with two hypotheses finished at step 2 and one live beam just below them."""
    group = BeamGroup(
        2, 10, frozenset({EOS}), length_penalty=length_penalty, early_stopping=early_stopping
    )
    group.select([offer([], 0.0, {5: 0.5, 6: 0.5, 7: 1e-6, 8: 1e-6})])
    beams = [
        offer([5], lp(0.5), {EOS: 0.6, 9: 0.3, 10: 0.05, 11: 0.05}),
        offer([6], lp(0.5), {EOS: 0.5, 12: 0.4, 13: 0.05, 14: 0.05}),
    ]
    group.select(beams)
    return group


def test_early_stopping_true_stops_once_w_hypotheses_are_finished():
    group = _two_finished_then(True, 1.0)
    assert len(group.finished) == 2 and group.done


def test_early_stopping_false_stops_when_the_best_live_beam_cannot_win_at_its_length():
    # Live beam 6,12: cum log(0.5*0.4) = -1.61, over 2 tokens -0.80; the worst finished
    # (5, EOS) has -1.39 / 2 = -0.69 and (6, EOS) -1.39 / 2: nothing better at length 2.
    group = _two_finished_then(False, 1.0)
    assert group.done


def test_never_goes_on_while_a_longer_sequence_could_still_win():
    # With length_penalty 2, the live beam divided by max_tokens ** 2 could beat them.
    group = _two_finished_then("never", 2.0)
    assert not group.done
    # With length_penalty 0 its score only falls: nothing better can come.
    assert _two_finished_then("never", 0.0).done


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="early_stopping"):
        BeamGroup(2, 4, frozenset(), early_stopping="sometimes")
    with pytest.raises(ValueError, match="early_stopping"):
        BeamGroup(2, 4, frozenset(), early_stopping=1)
    with pytest.raises(ValueError, match="width"):
        BeamGroup(0, 4, frozenset())


def test_a_huge_length_penalty_scores_instead_of_overflowing():
    group = BeamGroup(1, max_tokens=3, eos_token_ids=frozenset({EOS}), length_penalty=1e308)
    group.select([offer([], 0.0, {5: 0.9, 6: 0.1})])
    group.select([offer([5], lp(0.9), {EOS: 0.9, 6: 0.1})])
    assert group.finished[0].score == 0.0 and group.done
