"""docs/configuration.md is what docs/draw_configuration.py draws from the config classes,
and names every key a Serve app (and so `kvray serve`) accepts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import kvray_env
from cluster.app_config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def _draw() -> str:
    spec = importlib.util.spec_from_file_location(
        "draw_configuration", PAGE.with_name("draw_configuration.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.draw()


def test_page_is_drawn_from_the_configs():
    assert PAGE.read_text() == _draw(), "run python docs/draw_configuration.py"


def test_page_names_every_app_key():
    page = PAGE.read_text()
    assert [key for key in AppConfig.model_fields if f"| `{key}` |" not in page] == []


def test_page_names_every_switch():
    page = PAGE.read_text()
    assert [s.name for s in kvray_env.SWITCHES if f"| `{s.name}`" not in page] == []
