"""An output cut inside a multi-byte character (by max_tokens, say) ends before that
character: no U+FFFD, while its tokens are still reported."""

from __future__ import annotations

import pytest

from engine.bundled import bundled_model_path
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from tests.engine.test_tokenizer import WithoutRustBackend

REPLACEMENT = "\ufffd"
EMOJI = "Launch 🚀 now"


@pytest.fixture(scope="module", params=["rust-stream", "python-window"])
def tokenizer(request):
    loaded = load_tokenizer(bundled_model_path())
    return loaded if request.param == "rust-stream" else WithoutRustBackend(loaded)


def _cuts_inside_a_character(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT)]
    assert cuts, f"{text!r} should split a character across tokens"
    return cuts


def test_every_cut_inside_a_character_streams_and_ends_without_a_replacement_char(tokenizer):
    ids = tokenizer.encode(EMOJI)
    for cut in _cuts_inside_a_character(tokenizer, EMOJI):
        detok = IncrementalDetokenizer(tokenizer, [])
        deltas = []
        for token in ids[:cut]:
            detok.update([token])
            deltas.append(detok.get_delta())
        detok.finish()
        deltas.append(detok.get_delta())
        streamed = "".join(deltas)
        assert REPLACEMENT not in streamed
        assert streamed == detok.output_text == tokenizer.decode(ids[:cut])[:-1]
        assert EMOJI.startswith(detok.output_text)
        assert detok.token_ids == ids[:cut]


def test_a_replacement_char_inside_the_text_is_kept(tokenizer):
    # A stray continuation byte mid-output is the model's own text, not a cut.
    stray = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == REPLACEMENT)
    ids = [stray] + tokenizer.encode(" ok")
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.update(ids)
    detok.finish()
    assert detok.output_text == tokenizer.decode(ids) == REPLACEMENT + " ok"


def test_the_engine_s_length_cut_inside_a_character_reports_the_tokens_but_not_the_half():
    llm = LLM(max_model_len=128)
    params = SamplingParams(max_tokens=60, temperature=0, logprobs=0)
    out = llm.generate(["北京是中国的首都，"], params)[0].outputs[0]
    full = llm.get_tokenizer().decode(out.token_ids)
    assert out.finish_reason == "length"
    assert full.endswith(REPLACEMENT), "the greedy output should end inside a character"
    assert out.text == full[:-1]
    assert len(out.token_ids) == len(out.logprobs) == 60
