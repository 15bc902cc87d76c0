"""Imports point one way: console -> engine, never back; neither package imports itself back
through others (no cycle); screens reach the console's state, never the App class. Read from
the source text (ast), so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports(package: str) -> dict[str, set[str]]:
    """Module of `package` -> every module it names in an import (TYPE_CHECKING ones too)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[name] = targets - {name}
    return found


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports."""
    found = imports(package)
    return {name: targets & found.keys() for name, targets in found.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of modules, or None (depth-first, three colours)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph[module]):
            found = visit(target)
            if found is not None:
                return found
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module)
        if found is not None:
            return found
    return None


def test_neither_package_has_an_import_cycle() -> None:
    assert cycle_in(import_graph("console")) is None
    assert cycle_in(import_graph("engine")) is None


def test_the_engine_never_imports_the_console() -> None:
    backwards = {name: sorted(t for t in targets if t.split(".")[0] == "console")
                 for name, targets in imports("engine").items()}
    assert {name: found for name, found in backwards.items() if found} == {}


def test_the_cycle_finder_finds_one() -> None:
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


def test_screens_depend_on_the_state_not_the_app() -> None:
    graph = import_graph("console")
    screens = [m for m in graph if m.startswith("console.tui.screens.")]
    assert screens and all("console.tui.app" not in graph[m] for m in screens)
    assert "console.tui.state" in graph["console.tui.screens.base"]
