"""Draws the imports between kvray's packages into docs/imports.md.

    python docs/draw_imports.py

The modules of engine/, kernels/, cluster/ and serve_app.py are parsed, not imported. An
import counts wherever it stands (top level, inside a function, under TYPE_CHECKING), as
tests/unit/test_layers.py counts it. The drawing groups modules by subpackage; below it,
each module with the repository modules it imports.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "cluster")
SINGLE_MODULES = ("serve_app.py",)
# Subpackages drawn as groups of their own; the rest of a package is one group.
SUBPACKAGES = (
    "engine.api",
    "engine.core",
    "engine.layers",
    "engine.models",
    "engine.observability",
    "engine.worker",
)
OUTPUT = ROOT / "docs" / "imports.md"


def module_paths() -> dict[str, Path]:
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    paths += [ROOT / name for name in SINGLE_MODULES]
    modules = {}
    for path in paths:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def repository_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the repository modules it imports (`from a.b import c`: a.b.c when that is
    a module, else a.b)."""
    graph = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    keep = len(module.split(".")) - node.level + (path.name == "__init__.py")
                    base = ".".join(module.split(".")[:keep] + ([base] if base else []))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    found.add(submodule if submodule in modules else base)
        graph[module] = {m for m in found if m in modules and m != module}
    return graph


def group(module: str) -> str:
    for sub in SUBPACKAGES:
        if module == sub or module.startswith(sub + "."):
            return sub
    return module.split(".")[0]


def _label(name: str) -> str:
    return "engine (top-level modules)" if name == "engine" else name


def mermaid(graph: dict[str, set[str]]) -> list[str]:
    edges = Counter(
        (group(m), group(i))
        for m, imported in graph.items()
        for i in imported
        if group(m) != group(i)
    )
    groups = sorted({group(m) for m in graph})
    lines = ["```mermaid", "graph TD"]
    lines += [f'    {g.replace(".", "_")}["{_label(g)}"]' for g in groups]
    for (src, dst), count in sorted(edges.items()):
        lines.append(f"    {src.replace('.', '_')} -->|{count}| {dst.replace('.', '_')}")
    return lines + ["```"]


def module_list(graph: dict[str, set[str]]) -> list[str]:
    lines = []
    for g in sorted({group(m) for m in graph}):
        lines += ["", f"### {_label(g)}", ""]
        for module in sorted(m for m in graph if group(m) == g):
            imported = ", ".join(sorted(graph[module])) or "(nothing of the repository)"
            lines.append(f"- `{module}` -> {imported}")
    return lines


def render() -> str:
    graph = repository_imports(module_paths())
    lines = [
        "# Imports between packages",
        "",
        "Written by `python docs/draw_imports.py`; run it again after moving imports.",
        "An edge's number counts the module-to-module imports it stands for; imports within",
        "a group are not drawn. The layer order (tests/unit/test_layers.py checks it):",
        "serve_app -> cluster -> engine.api -> engine -> kernels.",
        "",
        *mermaid(graph),
        "",
        "## Each module's imports",
        *module_list(graph),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
