"""The layer order, read from the source: serve_app -> cluster -> engine.api -> engine -> kernels.

Every module of engine/, kernels/, cluster/ and serve_app.py is parsed (never imported).
An import counts wherever it stands: at the top, inside a function, under TYPE_CHECKING.
`from a.b import c` imports module a.b.c when there is one, else a.b.

Each check runs once per module, so a failure names the module that breaks the order.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kernels", "cluster")
SINGLE_MODULES = ("serve_app.py",)
CLUSTER_WORD = re.compile(r"\bcluster\b")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _sources() -> dict[str, Path]:
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    paths += [ROOT / name for name in SINGLE_MODULES]
    return {_module_name(p): p for p in paths}


@functools.cache
def _tree(module: str) -> ast.Module:
    path = _sources()[module]
    return ast.parse(path.read_text(), filename=str(path))


def _imported_base(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = _sources()[module].name == "__init__.py"
    parts = module.split(".")
    parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(parts + ([node.module] if node.module else []))


@functools.cache
def imports(module: str) -> frozenset[str]:
    """Every module name that `module` imports (of this repository or not)."""
    found = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _imported_base(module, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in _sources() else base)
    found.discard(module)
    return frozenset(found)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _strings(module: str) -> list[str]:
    """Every string constant, docstrings and f-string parts included."""
    return [
        node.value
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


@functools.cache
def _cycles() -> dict[str, frozenset[str]]:
    """Module -> the other modules of its import cycle (strongly connected component)."""
    graph = {m: [i for i in imports(m) if i in _sources()] for m in _sources()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: dict[str, frozenset[str]] = {}

    def visit(m: str) -> None:  # Tarjan's algorithm
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = set()
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.add(n)
                if n == m:
                    break
            for n in component:
                cycles[n] = frozenset(component - {n})

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return cycles


def _modules(*packages: str, outside: str | None = None) -> list:
    """pytest params: the modules within `packages` (all when none) but not within `outside`."""
    params = []
    for module in sorted(_sources()):
        if packages and not any(_within(module, p) for p in packages):
            continue
        if outside and _within(module, outside):
            continue
        params.append(pytest.param(module, id=module))
    return params


@pytest.mark.parametrize("module", _modules("engine", "kernels"))
def test_engine_and_kernels_import_no_cluster_or_serve_app(module):
    outward = {i for i in imports(module) if _within(i, "cluster") or _within(i, "serve_app")}
    assert not outward


@pytest.mark.parametrize("module", _modules("engine", "kernels"))
def test_engine_and_kernels_name_no_cluster_even_in_a_string(module):
    assert not [s for s in _strings(module) if CLUSTER_WORD.search(s)]


@pytest.mark.parametrize("module", _modules("kernels"))
def test_kernels_import_nothing_from_engine(module):
    assert not {i for i in imports(module) if _within(i, "engine")}


@pytest.mark.parametrize("module", _modules("engine", outside="engine.api"))
def test_engine_below_its_api_imports_nothing_from_it(module):
    assert not {i for i in imports(module) if _within(i, "engine.api")}


@pytest.mark.parametrize("module", _modules())
def test_module_is_on_no_import_cycle(module):
    assert not _cycles()[module]
