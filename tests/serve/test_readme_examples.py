"""The README's first examples work as written: its `curl` command and its `openai` snippet,
taken from the README's fenced code blocks, run against a Serve app of the bundled model.

The README's address (Serve's default, 127.0.0.1:8000) is replaced by the test server's
free port; nothing else of the examples changes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.serve_apps import delete_app, run_app

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"
APP = "readme"
ARGS = {"max_model_len": 512, "max_num_seqs": 4, "num_cpus": 0.25, "ingress_max_replicas": 1}
FENCED_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_example(language: str, starts_with: str) -> str:
    """The README's first `language` code block whose text starts with `starts_with`."""
    for block_language, text in FENCED_BLOCK.findall(README.read_text()):
        if block_language == language and text.startswith(starts_with):
            assert README_URL in text, f"the README's {starts_with!r} example names no server"
            return text
    raise AssertionError(f"README.md has no {language} block starting with {starts_with!r}")


@pytest.fixture(scope="module")
def url():
    yield run_app(APP, ARGS)
    delete_app(APP)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_example_answers(url):
    command = readme_example("bash", "curl ").replace(README_URL, url)
    # The status code on a line of its own after the body.
    command = command.replace(
        "curl ", "curl --silent --show-error --write-out '\\n%{http_code}' ", 1
    )
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    body, _, status = done.stdout.rpartition("\n")
    assert status == "200", done.stdout
    answer = json.loads(body)["choices"][0]["message"]["content"]
    assert answer.strip()


def test_readme_openai_example_answers(url):
    # The client raises on any status but 2xx: a clean exit is a 200.
    script = readme_example("python", "from openai import").replace(README_URL, url)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
