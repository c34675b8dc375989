"""Writes docs/configuration.md: every engine and Serve app key, and the KVRAY_* switches.

    python docs/draw_configuration.py

Each key's type, default and description come from the config classes themselves (the
engine's part configs in engine/config.py, the app's in cluster/serve_options.py and
cluster/app_config.py), the switches from kvray_env.py, so the page cannot drift from them
(tests/unit/test_configuration_page.py regenerates it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvray_env  # noqa: E402
from cluster.app_config import AppConfig  # noqa: E402
from cluster.serve_options import ServeOptions  # noqa: E402
from engine.arg_aliases import ALIASES  # noqa: E402
from engine.config import PART_CONFIGS, EngineConfig  # noqa: E402

OUTPUT = ROOT / "docs" / "configuration.md"

INTRO = """\
# Configuration

Every key of the engine (`LLM(...)`'s keyword arguments) and of a Serve app (`kvray serve
--key value`, `serve run serve_app:build_app key=value`, a Serve config file's `args:`), and
the `KVRAY_*` environment switches. Drawn from the config classes by `python
docs/draw_configuration.py`; do not edit by hand.
"""


def type_name(annotation: Any) -> str:
    """int | None, "fcfs" | "priority", dict[str, TenantConfig]: as a key's value is written."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    default = info.get_default(call_default_factory=True)
    return json.dumps(default) if isinstance(default, dict | list | str) else str(default)


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(rows: list[tuple[str, FieldInfo, str | None]]) -> list[str]:
    """rows: (key, field, description where the field has none of its own)."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, info, fallback in rows:
        description = info.description or fallback or ""
        lines.append(
            f"| `{name}` | `{cell(type_name(info.annotation))}` | `{cell(default_text(info))}` "
            f"| {cell(description)} |"
        )
    return lines


def _fields(cls: type[BaseModel]) -> list[tuple[str, FieldInfo, None]]:
    return [(name, info, None) for name, info in cls.model_fields.items()]


def _runner_fields() -> list[tuple[str, FieldInfo, None]]:
    """EngineConfig's own keys, beside its part configs."""
    parts = set(PART_CONFIGS)
    return [
        (name, info, None)
        for name, info in EngineConfig.model_fields.items()
        if info.annotation not in parts
    ]


def engine_section() -> list[str]:
    lines = ["## Engine keys", ""]
    for cls in PART_CONFIGS:
        lines += [f"### {cls.__name__}", "", *table(_fields(cls)), ""]
    lines += ["### EngineConfig", "", *table(_runner_fields()), ""]
    return lines


def _engine_field(name: str) -> FieldInfo | None:
    for cls in (*PART_CONFIGS, EngineConfig):
        if name in cls.model_fields:
            return cls.model_fields[name]
    return None


def serve_section() -> list[str]:
    app_only = [
        (name, info, None)
        for name, info in AppConfig.model_fields.items()
        if name not in ServeOptions.model_fields and _engine_field(name) is None
    ]
    differing = []
    for name, info in AppConfig.model_fields.items():
        engine = _engine_field(name)
        if engine is None:
            continue
        if info.annotation != engine.annotation or default_text(info) != default_text(engine):
            differing.append((name, info, engine.description))
    return [
        "## Serve app keys",
        "",
        "A Serve app takes every engine key above and these of its own.",
        "",
        *table(_fields(ServeOptions) + app_only),
        "",
        "### Engine keys whose app default differs",
        "",
        *table(differing),
        "",
    ]


def aliases_section() -> list[str]:
    lines = [
        "## Other names",
        "",
        "Names that serving guides use, taken wherever the key they stand for is (engine",
        "arguments, Serve app keys, `kvray serve` flags); given beside that key, refused.",
        "Those that stand for nothing are refused with a message saying what to use.",
        "",
        "| name | stands for | note |",
        "|---|---|---|",
    ]
    for alias, entry in ALIASES.items():
        key = f"`{entry.key}`" if entry.key else "refused"
        if entry.scale is not None:
            key = f"`{entry.key}` / {entry.scale:g}"
        if entry.kvray_behaviour is not None:
            key = f"`{str(entry.kvray_behaviour).lower()}` accepted (no change), else refused"
        lines.append(f"| `{alias}` | {key} | {cell(entry.note)} |")
    return [*lines, ""]


def switches_section() -> list[str]:
    lines = [
        "## Environment switches",
        "",
        "Read through kvray_env.py. Those marked *ranks* also reach the processes of a",
        "parallel group's ranks from the process that starts them.",
        "",
        "| variable | default | read by | what it does |",
        "|---|---|---|---|",
    ]
    for switch in kvray_env.SWITCHES:
        ranks = " *ranks*" if switch.to_ranks else ""
        default = f"`{switch.default}`" if switch.default else "unset"
        lines.append(
            f"| `{switch.name}`{ranks} | {default} | {cell(switch.reader)} "
            f"| {cell(switch.description)} |"
        )
    return [*lines, ""]


def draw() -> str:
    lines = [INTRO, *engine_section(), *serve_section(), *aliases_section(), *switches_section()]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(draw())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
