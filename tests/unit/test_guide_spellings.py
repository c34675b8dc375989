"""The guides' spellings of kvray's keys (engine/arg_aliases.py) and vLLM's server flags work in
every entry point: EngineArgs / LLM's keywords, a Serve app's keys (one model and `models`
entries) and the `kvray serve` flags. No Ray, no model."""

from __future__ import annotations

import pytest

import engine.tokenizer
from bench.word_tokenizer import write_word_tokenizer
from cluster.app_config import load_app_config
from cluster.cli import parse_serve_args
from engine.arg_aliases import ALIASES
from engine.config import EngineArgs
from engine.tokenizer import load_tokenizer

RENAMED = [(alias, entry.key) for alias, entry in ALIASES.items() if entry.key is not None]
REFUSED = {
    "max_num_batches": r"max_num_batches: .*pipeline_parallel_size.*max_num_seqs",
    "skip_special_tokens": r"skip_special_tokens: a field of each request .* set it per request",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_the_table_names_real_keys_and_refuses_what_has_none():
    assert {alias for alias, entry in ALIASES.items() if entry.key is None} == set(REFUSED)
    assert dict(RENAMED) == {
        "request_timeout": "request_timeout_s",
        "max_batch_size": "max_num_seqs",
        "batch_timeout": "batch_wait_timeout_ms",
    }


def test_max_batch_size_is_max_num_seqs_in_engine_arguments():
    assert EngineArgs(max_batch_size=12).max_num_seqs == 12
    assert EngineArgs(max_batch_size=12).create_engine_config().scheduler_config.max_num_seqs == 12


@pytest.mark.parametrize(("alias", "key"), RENAMED)
def test_an_alias_reaches_its_key_as_an_app_key_a_models_entry_key_and_a_flag(alias, key):
    value = 7 * (ALIASES[alias].scale or 1)  # batch_timeout: seconds, its key ms
    assert getattr(load_app_config({alias: "7"}), key) == value
    flagged, _ = parse_serve_args(["serve", _flag(alias), "7"])
    assert getattr(flagged, key) == value
    if key in ("max_num_seqs", "batch_wait_timeout_ms"):  # per-model keys: in the entry
        entry = load_app_config({"models": [{"model": "m", alias: 7}]}).model_configs()[0]
        assert getattr(entry, key) == value
        assert getattr(EngineArgs(**{alias: 7}), key) == value


def test_batch_timeout_is_in_seconds_and_reaches_the_engine_in_ms(capsys):
    assert EngineArgs(batch_timeout=0.05).batch_wait_timeout_ms == 50
    config, _ = parse_serve_args(["serve", "--batch-timeout", "0.05"])
    assert config.engine_args().batch_wait_timeout_ms == 50
    flagged, _ = parse_serve_args(["serve", "--batch-wait-timeout-ms", "20"])
    assert flagged.engine_args().batch_wait_timeout_ms == 20
    for bad in ("soon", "nan", True):
        with pytest.raises(ValueError, match="batch_timeout must be a finite number"):
            load_app_config({"batch_timeout": bad})
    with pytest.raises(ValueError, match="batch_wait_timeout_ms"):
        load_app_config({"batch_timeout": -1})
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", "--batch-wait-timeout-ms", "-1"])
    assert "batch_wait_timeout_ms" in capsys.readouterr().err


def test_request_timeout_takes_none_like_request_timeout_s():
    config, _ = parse_serve_args(["serve", "--request-timeout", "none"])
    assert config.request_timeout_s is None
    with pytest.raises(ValueError, match=r"models\[0\]\.request_timeout_s: an app-wide key"):
        load_app_config({"models": [{"model": "m", "request_timeout": 5}]})


@pytest.mark.parametrize(("alias", "key"), RENAMED)
def test_an_alias_beside_its_key_is_refused_naming_both(alias, key, capsys):
    both = rf"{alias} is another name for {key}: give {key} or {alias}, not both"
    with pytest.raises(ValueError, match=both):
        load_app_config({alias: 3, key: 3})
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", _flag(alias), "3", _flag(key), "3"])
    assert f"give {key} or {alias}, not both" in capsys.readouterr().err
    if key in ("max_num_seqs", "batch_wait_timeout_ms"):
        with pytest.raises(ValueError, match=both):
            EngineArgs(**{alias: 3, key: 3})
        with pytest.raises(ValueError, match=rf"models\[0\]: {both}"):
            load_app_config({"models": [{"model": "m", alias: 3, key: 3}]})


@pytest.mark.parametrize(("alias", "message"), REFUSED.items())
def test_aliases_without_an_equivalent_are_refused_saying_what_to_use(alias, message, capsys):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{alias: 2})
    with pytest.raises(ValueError, match=message):
        load_app_config({alias: 2})
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", _flag(alias), "2"])
    assert f"{alias}: " in capsys.readouterr().err


def test_skip_special_tokens_as_a_switch_runs_and_false_is_refused_saying_why(capsys):
    switched, _ = parse_serve_args(["serve", "--skip-special-tokens"])
    assert switched == parse_serve_args(["serve"])[0]
    assert load_app_config({"skip_special_tokens": True}) == load_app_config({})
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", "--skip-special-tokens", "false"])
    assert "skip_special_tokens: a field of each request" in capsys.readouterr().err
    with pytest.raises(ValueError, match="set it per request"):
        EngineArgs(skip_special_tokens=False)


def test_an_app_only_alias_is_unknown_to_the_engine():
    with pytest.raises(ValueError, match="unknown engine argument.*request_timeout"):
        EngineArgs(request_timeout=5)


def test_vllms_server_flags_reach_the_engine_arguments():
    config, _ = parse_serve_args(
        [
            "serve", "--gpu-memory-utilization", "0.8", "--quantization", "awq",
            "--tokenizer-mode", "slow", "--request-timeout", "300",
        ]
    )  # fmt: skip
    assert config.request_timeout_s == 300
    args = config.engine_args()
    assert (args.gpu_memory_utilization, args.quantization, args.tokenizer_mode) == (
        0.8,
        "awq",
        "slow",
    )
    with pytest.raises(ValueError, match="tokenizer_mode"):
        load_app_config({"tokenizer_mode": "fast"})


def test_slow_tokenizer_mode_asks_transformers_for_the_python_tokenizer(tmp_path, monkeypatch):
    folder = write_word_tokenizer(tmp_path / "tok", vocab_size=64)
    assert load_tokenizer(folder).is_fast
    asked = {}

    class PythonTokenizer:
        is_fast = False

    def from_pretrained(path, **kwargs):
        asked.update(kwargs)
        return PythonTokenizer()

    monkeypatch.setattr(engine.tokenizer.AutoTokenizer, "from_pretrained", from_pretrained)
    assert isinstance(load_tokenizer(folder, tokenizer_mode="slow"), PythonTokenizer)
    assert asked["use_fast"] is False


def test_slow_tokenizer_mode_is_refused_where_transformers_gives_a_fast_one(tmp_path):
    folder = write_word_tokenizer(tmp_path / "tok", vocab_size=64)
    # A WordLevel tokenizer.json has no Python tokenizer in any transformers version.
    with pytest.raises(ValueError, match=r"tokenizer_mode='slow' .* use tokenizer_mode='auto'"):
        load_tokenizer(folder, tokenizer_mode="slow")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ValueError, match=r"tokenizer_mode='slow' cannot apply to a GGUF"):
        load_tokenizer(gguf, tokenizer_mode="slow")
