"""KVRAY_PROFILE_STEPS profiles a window of a rank's steps and writes its tables."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.observability.step_profiler import StepProfiler
from tests.support.tiny_models import write_tiny_llama


def test_a_window_of_steps_is_profiled_and_written(tmp_path, monkeypatch):
    out = tmp_path / "profile"
    monkeypatch.setenv("KVRAY_PROFILE_STEPS", f"2:5:{out}")
    llm = LLM(write_tiny_llama(tmp_path / "model"), max_model_len=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        llm.generate([[5, 6, 7]], params)
        assert not out.exists()  # steps 0..2 only: the window has not closed yet
        llm.generate([[8, 9]], params)
    finally:
        llm.engine.shutdown()
    table = (out / "rank0.txt").read_text()
    assert table.startswith("rank 0, steps 2..4")
    assert "aten::" in table  # the model's ops inside the window
    assert (out / "rank0.json").stat().st_size > 0


@pytest.mark.parametrize("spec", ["5", "3:2:/tmp/x", "a:b:/tmp/x"])
def test_a_malformed_window_is_refused_naming_the_variable(monkeypatch, spec):
    monkeypatch.setenv("KVRAY_PROFILE_STEPS", spec)
    with pytest.raises(ValueError, match="KVRAY_PROFILE_STEPS"):
        StepProfiler.from_env(rank=0)
