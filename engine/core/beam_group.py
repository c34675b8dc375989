"""One beam search's choices, step by step, as transformers' beam search makes them.

Each step every live beam offers its best next tokens with their logprobs; `select` keeps
what `generate(num_beams=W, do_sample=False)` keeps:

- the candidates are the 2W best (W per end-of-sequence id, at least 2W) of every live
  beam's next tokens, by cumulative logprob;
- a candidate that ends its sequence (an EOS id, or the length limit) becomes a finished
  hypothesis if it ranks among the first W, scored `cum_logprob / length ** length_penalty`
  (length: generated tokens, the EOS included); the W best hypotheses are kept;
- the W best candidates that do not end are the next step's beams;
- the search ends when nothing is left to continue, or by `early_stopping`: True, as soon
  as W hypotheses are finished; False, when the best live beam scored at its current
  length cannot beat the worst of W finished hypotheses (a heuristic); "never", when it
  cannot beat it at any length it could still reach (with a positive length penalty the
  longest; else the current length, as scores only fall), so the search stops only when
  nothing better can come: the same best sequences as a search run to its last token.

Pure bookkeeping: the engine's side (which request computes which beam, forks) is
engine/beam_search.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

EarlyStopping = bool | str
EARLY_STOPPING_MODES = (True, False, "never")


@dataclass
class Hypothesis:
    """A finished sequence: generated token ids (a final EOS included) and its scores."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    ended_by_eos: bool


@dataclass
class Continuation:
    """A beam of the next step: live beam `parent`'s tokens plus `token_id`."""

    parent: int
    token_id: int
    cum_logprob: float


@dataclass
class BeamOffer:
    """What a live beam brings to a step: its generated tokens, its cumulative logprob and
    its best next tokens as (token id, logprob), most likely first."""

    token_ids: list[int]
    cum_logprob: float
    next_tokens: list[tuple[int, float]]


class BeamGroup:
    def __init__(
        self,
        width: int,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = "never",
    ):
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if early_stopping not in EARLY_STOPPING_MODES or type(early_stopping) not in (bool, str):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {early_stopping!r}"
            )
        self.width = width
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * width
        """Next tokens each live beam must offer (and the candidates a step ranks)."""
        self.num_generated = 0
        """Tokens the live beams have generated."""
        self.finished: list[Hypothesis] = []
        """The best W hypotheses so far, best first."""
        self.done = False
        self._improvable = True

    def select(self, offers: list[BeamOffer]) -> list[Continuation]:
        """One step: the next beams (none once the search is done, see `done`)."""
        if self.done:
            raise ValueError("the beam search is done")
        ranked = sorted(
            (
                (offer.cum_logprob + logprob, i, token)
                for i, offer in enumerate(offers)
                for token, logprob in offer.next_tokens
            ),
            key=lambda c: -c[0],
        )[: self.num_candidates]
        length = self.num_generated + 1
        at_limit = length >= self.max_tokens
        running: list[Continuation] = []
        ending: list[Hypothesis] = []
        for rank, (cum_logprob, i, token) in enumerate(ranked):
            ends_by_eos = token in self.eos_token_ids
            if not (ends_by_eos or at_limit):
                if len(running) < self.width:
                    running.append(Continuation(i, token, cum_logprob))
            elif rank < self.width:
                score = normalized_score(cum_logprob, length, self.length_penalty)
                tokens = [*offers[i].token_ids, token]
                ending.append(Hypothesis(tokens, cum_logprob, score, ends_by_eos))
        if self._improvable and not self._full_and_early():
            self.finished = sorted(self.finished + ending, key=lambda h: -h.score)[: self.width]
        self.num_generated = length
        if running and len(self.finished) == self.width:
            self._improvable = self._best_possible(running[0].cum_logprob) > self.finished[-1].score
        self.done = not running or not self._improvable or self._full_and_early()
        return [] if self.done else running

    def _full_and_early(self) -> bool:
        return self.early_stopping is True and len(self.finished) == self.width

    def _best_possible(self, cum_logprob: float) -> float:
        """The best score the best live beam could still reach, as `early_stopping` judges."""
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_tokens  # its logprob can only fall; a longer length lifts it
        else:
            length = self.num_generated
        return normalized_score(cum_logprob, length, self.length_penalty)


def normalized_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty; a length factor past float's range (a huge
    penalty) scores 0 rather than raising."""
    try:
        return cum_logprob / length**length_penalty
    except OverflowError:
        return cum_logprob * 0.0
