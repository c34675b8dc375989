import pickle

import pytest

from engine.sampling_params import RequestInputError, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output) == (
        False,
        True,
        False,
    )
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy


def test_single_stop_string_is_wrapped():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_is_normalised_to_zero(top_k):
    assert SamplingParams(top_k=top_k).top_k == 0


def test_greedy_and_seeded_sampling_types():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0, seed=3).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_max_tokens_none_and_valid_edges_accepted():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    p = SamplingParams(top_p=1, min_p=1, presence_penalty=-2, frequency_penalty=2, logprobs=20)
    assert p.top_p == 1.0 and p.logprobs == 20
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert SamplingParams(logprobs=0).logprobs == 0


def test_survives_pickling():
    p = SamplingParams(temperature=0.5, stop=["x"], stop_token_ids=[3], seed=7, logprobs=2)
    assert pickle.loads(pickle.dumps(p)) == p


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"output_kind": 1}, "output_kind"),
        ({"output_kind": "final"}, "output_kind"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
        ({"logit_bias": {7: 100.5}}, "logit_bias"),
        ({"logit_bias": {7: float("inf")}}, "logit_bias"),
        ({"logit_bias": {7: "up"}}, "logit_bias"),
        ({"logit_bias": {2**63: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [2**64]}, "allowed_token_ids"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_error_message_states_the_allowed_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\], got 21"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"presence_penalty": 2.0000001}, r"presence_penalty must be in \[-2, 2\], got 2.0000001"),
        ({"frequency_penalty": -2.0000001}, r"must be in \[-2, 2\], got -2.0000001"),
        ({"top_p": 1.0000001}, r"top_p must be in \(0, 1\], got 1.0000001"),
        ({"min_p": 1.0000001}, r"min_p must be in \[0, 1\], got 1.0000001"),
        ({"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\], got 3.0$"),
        ({"logit_bias": {5: 100.0000001}}, r"\[-100, 100\], got 100.0000001 for token 5"),
    ],
)
def test_range_errors_show_the_value_unrounded(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_an_int_too_large_for_a_float_is_a_value_error():
    with pytest.raises(ValueError, match="presence_penalty must be a finite number"):
        SamplingParams(presence_penalty=10**400)


def test_request_input_error_keeps_its_field_across_processes():
    error = pickle.loads(pickle.dumps(RequestInputError("prompt", "token id 9 is out of range")))
    assert isinstance(error, ValueError)
    assert (error.field, error.problem) == ("prompt", "token id 9 is out of range")
    assert str(error) == "prompt token id 9 is out of range"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"use_beam_search": 1}, "use_beam_search"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"length_penalty": "1"}, "length_penalty"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"early_stopping": 1}, "early_stopping"),
        ({"use_beam_search": True, "n": 11}, "n"),
    ],
)
def test_beam_search_fields_are_checked_by_name(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_beam_search_defaults_and_what_it_ignores():
    from engine.beam_search_fields import beam_search_ignored_fields

    p = SamplingParams(use_beam_search=True, n=4)
    assert (p.length_penalty, p.early_stopping) == (1.0, "never")
    assert beam_search_ignored_fields(p) == []
    assert beam_search_ignored_fields(SamplingParams(use_beam_search=True, temperature=0)) == []
    p = SamplingParams(use_beam_search=True, temperature=0.7, top_p=0.9, seed=3, stop=["x"])
    assert beam_search_ignored_fields(p) == ["temperature", "top_p", "seed", "stop"]
    with pytest.raises(ValueError, match="structured_output"):
        from engine.sampling_params import StructuredOutput

        SamplingParams(use_beam_search=True, structured_output=StructuredOutput(regex="a"))
