"""Beam search on the bundled model equals transformers' beam search (float32), and the
`SamplingParams(use_beam_search=True)` form of it runs the same search."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import SamplingParams
from engine.beam_search import BeamSearchParams
from tests.support.prompts import PROMPTS

MAX_TOKENS = 8
# Short prompts of several kinds and languages (the long one would only slow the reference).
BEAM_PROMPTS = PROMPTS[:7] + ["Hello, my name is"]


def _hf_beam_search(hf, prompt: str, width: int, length_penalty: float, early_stopping):
    tok, model = hf
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            max_new_tokens=MAX_TOKENS,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.eos_token_id,
        )
    best = out.sequences[0, ids.shape[1] :].tolist()
    eos = tok.eos_token_id
    if eos in best:  # a shorter best sequence is padded after its EOS
        best = best[: best.index(eos) + 1]
    return best, out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(hf, bundled_llm, width):
    # The default early_stopping ("never") and a length penalty that favours longer ones.
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=1.5)
    outputs = bundled_llm.beam_search(BEAM_PROMPTS, params)
    for prompt, output in zip(BEAM_PROMPTS, outputs, strict=True):
        best, scores = _hf_beam_search(hf, prompt, width, 1.5, "never")
        sequences = output.sequences
        assert len(sequences) == width
        assert sequences[0].output_token_ids == best, prompt
        assert [s.score for s in sequences] == pytest.approx(scores, abs=1e-4), prompt
        assert sequences[0].tokens[: sequences[0].num_prompt_tokens] == bundled_llm.engine.encode(
            prompt
        )
        # Each sequence's score is its cumulative logprob over its length, best first.
        for s in sequences:
            assert s.score == pytest.approx(s.cum_logprob / len(s.output_token_ids) ** 1.5)
        assert [s.score for s in sequences] == sorted((s.score for s in sequences), reverse=True)


def test_generate_with_use_beam_search_runs_the_search_and_names_what_it_ignores(
    bundled_llm, caplog
):
    prompt = BEAM_PROMPTS[0]
    params = SamplingParams(
        n=3, temperature=0.7, top_p=0.9, length_penalty=1.0, use_beam_search=True, max_tokens=6
    )
    with caplog.at_level(logging.WARNING, logger="engine.beam_search"):
        (out,) = bundled_llm.generate(prompt, params)
    assert "temperature" in caplog.text and "top_p" in caplog.text
    (searched,) = bundled_llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6))
    assert [o.token_ids for o in out.outputs] == [s.output_token_ids for s in searched.sequences]
    assert [o.cumulative_logprob for o in out.outputs] == [
        s.cum_logprob for s in searched.sequences
    ]
    tok = bundled_llm.get_tokenizer()
    for o in out.outputs:
        ids = o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids
        assert o.text == tok.decode(ids, skip_special_tokens=True)
    assert not bundled_llm.engine.has_unfinished_requests()


def test_a_beam_search_output_crosses_from_the_engine_process_with_its_logprob_sums():
    from engine.core_process import OutputDecoder, OutputEncoder
    from engine.outputs import CompletionOutput, RequestOutput

    outputs = [
        CompletionOutput(i, f"text {i}", [5, 6 + i], "length", cumulative_logprob=-1.5 - i)
        for i in range(2)
    ]
    final = RequestOutput("b", "p", [1, 2], outputs, finished=True)
    (got,) = OutputDecoder().decode(OutputEncoder().encode([final]))
    assert got == final
