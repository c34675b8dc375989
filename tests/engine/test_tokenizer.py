import random
from types import SimpleNamespace

import pytest

from engine.bundled import bundled_model_path
from engine.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    encode_text,
    load_tokenizer,
)

CHINESE = (
    "人工智能是计算机科学的一个分支，它企图了解智能的实质，"
    "并生产出一种新的能以人类智能相似的方式做出反应的智能机器。"
    "该领域的研究包括机器人、语言识别、图像识别、自然语言处理和专家系统等。🚀✨"
)


class WithoutRustBackend:
    """The same tokenizer without its `tokenizers` backend in view, as a slow (Python)
    tokenizer is: the detokenizer then decodes windows itself instead of streaming."""

    _tokenizer = None

    def __init__(self, tokenizer):
        self._wrapped = tokenizer

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


@pytest.fixture(scope="module", params=["rust-stream", "python-window"])
def tokenizer(request, bundled_tokenizer):
    if request.param == "rust-stream":
        return bundled_tokenizer
    return WithoutRustBackend(bundled_tokenizer)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feeds ids one at a time like the engine does; returns the deltas and the stop string."""
    deltas = []
    stop = None
    for token in ids:
        stop = detok.update([token])
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    else:
        detok.finish()
        deltas.append(detok.get_delta())
    return deltas, stop


def test_streaming_chinese_never_yields_half_characters(tokenizer):
    ids = tokenizer.encode(CHINESE)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces), "the text should split characters across tokens"
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    deltas, stop = stream(detok, ids)
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == CHINESE


def test_streaming_equals_full_decode_for_arbitrary_tokens(tokenizer):
    rng = random.Random(0)
    # Random ids include lone UTF-8 continuation bytes; the stream must still match decode().
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        deltas, _ = stream(detok, ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_output_cut_inside_a_character_leaves_the_character_out_after_finish(tokenizer):
    ids = tokenizer.encode(CHINESE)
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in ids[:cut]:
        detok.update([token])
    assert "\ufffd" not in detok.get_delta() + detok.output_text
    detok.finish()
    # A request that ends inside a character shows the text before it (tests/engine/
    # test_length_cut_text.py has the rest).
    assert detok.output_text == tokenizer.decode(ids[:cut]).removesuffix("\ufffd")
    assert "\ufffd" not in detok.get_delta()


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi there") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    stream(kept, ids)
    assert kept.output_text == "Hi there<|im_end|>"
    skipped = IncrementalDetokenizer(tokenizer, [])
    stream(skipped, ids)
    assert skipped.output_text == "Hi there"


def assert_prefixes_of_final(deltas: list[str], final: str):
    shown = ""
    for d in deltas:
        shown += d
        assert final.startswith(shown), f"{shown!r} was shown but the output is {final!r}"
    assert shown == final


def test_stop_string_split_across_tokens_stops_and_is_trimmed(tokenizer):
    text = "Hello world, this is the END of the story."
    ids = tokenizer.encode(text)
    stop = "is the EN"
    assert not any(stop in tokenizer.decode([t]) for t in ids), "stop must span tokens"
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    deltas, matched = stream(detok, ids)
    assert matched == stop and detok.stop_str == stop and detok.finished
    assert detok.output_text == "Hello world, this "
    # No delta ever showed a beginning of the stop string that was trimmed later.
    assert_prefixes_of_final(deltas, detok.output_text)
    assert len(deltas) < len(ids), "streaming must stop at the stop string"


def test_stop_string_kept_when_asked(tokenizer):
    ids = tokenizer.encode("one two three four five")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["ree f"], include_stop_str_in_output=True)
    deltas, matched = stream(detok, ids)
    assert matched == "ree f"
    assert detok.output_text == "one two three f"
    assert_prefixes_of_final(deltas, detok.output_text)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma")
    # Both complete with the token " beta"; the one that starts first ends the text.
    detok = IncrementalDetokenizer(tokenizer, [], stop=["beta", "ha b"])
    deltas, matched = stream(detok, ids)
    assert matched == "ha b" and detok.output_text == "alp"
    assert_prefixes_of_final(deltas, "alp")


def test_partial_stop_held_back_then_released(tokenizer):
    ids = tokenizer.encode("the answer is 42 and the end")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["the endgame"])
    deltas, matched = stream(detok, ids)
    assert matched is None
    # "...the end" might still have become "the endgame": held until finish() released it.
    assert not "".join(deltas[:-1]).endswith("the end")
    assert deltas[-1].endswith("the end")
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids)


def test_held_text_is_released_once_the_stop_cannot_match(tokenizer):
    ids = tokenizer.encode("abc abd xyz")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["abx"])
    shown = ""
    for token in ids:
        detok.update([token])
        shown += detok.get_delta()
    assert shown == "abc abd xyz"  # nothing here is a prefix of "abx", so nothing is held


def test_stop_strings_ignored_below_min_tokens(tokenizer):
    ids = tokenizer.encode("stop here and stop there")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["stop"], min_tokens=2)
    _, matched = stream(detok, ids)
    assert matched == "stop"
    assert detok.output_text == "stop here and "


def test_chat_template_matches_hf(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "你好"},
    ]
    for add in (True, False):
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add, tokenize=True, return_dict=False
        )
        assert apply_chat_template(tokenizer, messages, add_generation_prompt=add) == list(expected)
    with_prompt = apply_chat_template(tokenizer, messages)
    assert tokenizer.decode(with_prompt).endswith("<|im_start|>assistant\n")


def test_a_final_message_can_be_continued(tokenizer):
    messages = [
        {"role": "user", "content": "Introduce yourself."},
        {"role": "assistant", "content": "Hello, my name"},
    ]
    ids = apply_chat_template(
        tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    )
    expected = tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nHello, my name")
    closed = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    assert tokenizer.decode(closed).rstrip().endswith("<|im_end|>")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        apply_chat_template(tokenizer, messages, continue_final_message=True)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "messages"),
        ([{"role": "function", "content": "x"}], "function"),
        ([{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}], "bot"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": None}], "content"),
        (["hello"], "messages"),
    ],
)
def test_bad_messages_raise_value_error(tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        apply_chat_template(tokenizer, messages)


def test_tokenizer_without_chat_template_raises():
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(no_template, [{"role": "user", "content": "x"}])


def test_missing_tokenizer_source_names_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="model.gguf"):
        load_tokenizer(tmp_path, gguf_file="model.gguf")


ENCODE_TEXTS = [
    "The capital of France is",
    "  leading and trailing spaces  ",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    CHINESE,
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\r\nnewlines\n\n\nemoji 🚀✨ and accents éàü",
    "",
]


def test_encode_text_gives_the_hf_encode_ids(tokenizer, tmp_path):
    from bench.word_tokenizer import write_word_tokenizer

    words = load_tokenizer(write_word_tokenizer(tmp_path, vocab_size=1000))
    cases = [(tokenizer, text) for text in ENCODE_TEXTS] + [
        (words, " ".join(f"t{i}" for i in range(0, 1000, 7))),
        (words, "t1  t2\nt999 unknown"),
    ]
    for tok, text in cases:
        assert encode_text(tok, text) == tok.encode(text, add_special_tokens=False), text


def test_encode_text_with_truncation_set_on_the_backend_still_encodes_everything():
    loaded = load_tokenizer(bundled_model_path())
    loaded.backend_tokenizer.enable_truncation(max_length=4)
    text = ENCODE_TEXTS[2]
    ids = encode_text(loaded, text)
    assert len(ids) > 4
    assert ids == loaded.encode(text, add_special_tokens=False)
