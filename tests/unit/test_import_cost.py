"""`kvray serve --help` and the ingress's modules load no torch (torch takes seconds to
import): each is checked in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SERVE_HELP = """
import contextlib, io
from cluster.cli import main
with contextlib.redirect_stdout(io.StringIO()) as help_text:
    try:
        main(["serve", "--help"])
    except SystemExit as e:
        assert e.code == 0, e.code
assert "--tensor-parallel-size" in help_text.getvalue()
"""


def _loads_torch(code: str) -> bool:
    probe = code + "\nimport sys\nprint('torch' in sys.modules)\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1] == "True"


def test_kvray_serve_help_loads_no_torch():
    assert not _loads_torch(SERVE_HELP)


@pytest.mark.parametrize("module", ["cluster.ingress", "cluster.app_config", "engine.config"])
def test_importing_the_ingress_and_the_app_keys_loads_no_torch(module):
    assert not _loads_torch(f"import {module}")
