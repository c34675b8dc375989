"""kvray_env.py is the one table of kvray's KVRAY_* switches: code names none outside it, and
every entry is read somewhere."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import kvray_env

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"KVRAY_\w+")


def _python_sources(*roots: str) -> list[Path]:
    paths = []
    for root in roots:
        path = ROOT / root
        paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return paths


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants (prose may name a switch; code may not)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
        # attribute docstrings: a string statement after an assignment
        for statement in body if isinstance(body, list) else []:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                found.add(id(statement.value))
    return found


def _names_in_code(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found += NAME.findall(node.value)
        elif isinstance(node, ast.Name):
            found += NAME.findall(node.id)
        elif isinstance(node, ast.Attribute):
            found += NAME.findall(node.attr)
    return found


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=str(p.relative_to(ROOT)))
        for p in _python_sources("engine", "kernels", "cluster", "bench", "serve_app.py")
    ],
)
def test_code_names_kvray_switches_only_through_the_table(path):
    assert not _names_in_code(path), "read it through kvray_env's accessor"


def _readers() -> str:
    """The text of every module and script that may read a switch."""
    paths = _python_sources("engine", "kernels", "cluster", "bench", "serve_app.py")
    paths += sorted((ROOT / "cluster").rglob("*.sh"))
    return "\n".join(p.read_text() for p in paths)


def _accessors(switch: kvray_env.Switch) -> list[str]:
    attribute = next(k for k, v in vars(kvray_env).items() if v is switch)
    return [
        name
        for name, function in inspect.getmembers(kvray_env, inspect.isfunction)
        if function.__module__ == "kvray_env" and f"{attribute}." in inspect.getsource(function)
    ]


@pytest.mark.parametrize("switch", kvray_env.SWITCHES, ids=lambda s: s.name)
def test_every_switch_is_read_somewhere(switch):
    text = _readers()
    read_in_python = [a for a in _accessors(switch) if f"kvray_env.{a}()" in text]
    read_by_a_script = switch.name in text  # a shell script names the variable itself
    assert read_in_python or read_by_a_script


def test_the_table_names_each_switch_once():
    names = [s.name for s in kvray_env.SWITCHES]
    assert len(names) == len(set(names))
    assert all(NAME.fullmatch(n) for n in names)
    module_switches = [v for v in vars(kvray_env).values() if isinstance(v, kvray_env.Switch)]
    assert len(module_switches) == len(kvray_env.SWITCHES)


def test_ranks_get_the_switches_flagged_for_them():
    from_table = {s.name for s in kvray_env.SWITCHES if s.to_ranks}
    assert set(kvray_env.FORWARDED_TO_RANKS) == from_table
    assert from_table == {"KVRAY_PROFILE_STEPS", "KVRAY_NCCL_ONLY", "KVRAY_TORCH_KERNELS"}


def test_accessors_read_the_environment_each_call(monkeypatch):
    monkeypatch.delenv("KVRAY_PDL", raising=False)
    assert kvray_env.pdl()
    monkeypatch.setenv("KVRAY_PDL", "0")
    assert not kvray_env.pdl()
    monkeypatch.setenv("KVRAY_TORCH_KERNELS", "")
    assert not kvray_env.torch_kernels()
    monkeypatch.setenv("KVRAY_HOP_TRACE", "/tmp/h")
    assert kvray_env.hop_trace_folder() == "/tmp/h"
