"""Imports point one way: engine's packages in one order (PACKAGE_ORDER), console above all of
engine; no module cycle; screens reach the console's state, never the App class. Read from
the source text (ast, TYPE_CHECKING imports included), so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# low -> high: a package may import only its own and lower ones. "leaves" are engine/*.py;
# the root package (engine/__init__.py) hands out the equipped Engine, so it sits with ops.
PACKAGE_ORDER = ("leaves", "kernels", "model", "budget", "core", "ops", "store", "calibration",
                 "harness", "sim", "serve", "console")


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


def layer(module: str) -> str:
    """The package of PACKAGE_ORDER a module of engine or console belongs to."""
    parts = module.split(".")
    if parts[0] == "console":
        return "console"
    if module == "engine":
        return "ops"
    if len(parts) == 2 and (ROOT / "engine" / f"{parts[1]}.py").exists():
        return "leaves"
    return parts[1]


def imports_against_the_order() -> list[str]:
    """'importer -> imported (importer's package < imported's)' for every upward import."""
    rank = {name: i for i, name in enumerate(PACKAGE_ORDER)}
    known = {**import_graph("engine"), **import_graph("console")}
    found = []
    for module, targets in sorted(known.items()):
        for target in sorted(targets & known.keys()):
            if rank[layer(target)] > rank[layer(module)]:
                found.append(f"{module} ({layer(module)}) -> {target} ({layer(target)})")
    return found


def test_packages_import_only_lower_packages() -> None:
    offending = imports_against_the_order()
    assert not offending, "imports against the package order:\n  " + "\n  ".join(offending)


# the console's own packages, low -> high: the shell (cli) hands the screens (tui) what they
# need from it, such as the twin run, rather than the screens reaching up for it
CONSOLE_ORDER = ("leaves", "sources", "tui", "cli")


def test_the_consoles_packages_import_one_way() -> None:
    graph = import_graph("console")

    def part(module: str) -> str:
        parts = module.split(".")
        return "leaves" if len(parts) == 2 and parts[1] not in CONSOLE_ORDER else parts[1]

    rank = {name: i for i, name in enumerate(CONSOLE_ORDER)}
    upward = [f"{module} -> {target}" for module, targets in sorted(graph.items())
              for target in sorted(targets) if rank[part(target)] > rank[part(module)]]
    assert not upward, "imports against the console's order:\n  " + "\n  ".join(upward)


def test_every_engine_package_has_a_place_in_the_order() -> None:
    packages = {layer(m) for m in import_graph("engine")}
    assert packages <= set(PACKAGE_ORDER), packages - set(PACKAGE_ORDER)


def test_the_cycle_finder_finds_one() -> None:
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


# The TUI reads stored rows only through its Source, so every source (a recording, a remote
# server) answers the same calls; and it runs no workload or chaos of the bench harness.
FORBIDDEN_TO_THE_TUI = ("engine.store", "engine.harness")


def within(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == module or name.startswith(f"{module}.") for module in modules)


def test_the_tui_reads_the_store_only_through_its_source() -> None:
    reaching = {module: sorted(t for t in targets if within(t, FORBIDDEN_TO_THE_TUI))
                for module, targets in imports("console").items()
                if within(module, ("console.tui",))}
    assert reaching and {m: found for m, found in reaching.items() if found} == {}


def test_screens_depend_on_the_state_not_the_app() -> None:
    graph = import_graph("console")
    screens = [m for m in graph if m.startswith("console.tui.screens.")]
    assert screens and all("console.tui.app" not in graph[m] for m in screens)
    assert "console.tui.state" in graph["console.tui.screens.base"]


# engine/harness/ is for workloads, baselines and chaos: the twin (engine/sim) replays its
# workloads and these commands run them. Nothing the runtime runs (core, ops, store,
# calibration, serve, the console's screens and its other sources) imports it.
RUN_WORKLOADS = ("console.cli.bench", "console.cli.chaos", "console.cli.report",
                 "console.cli.run", "console.cli.traces", "console.cli.workload_flags",
                 "console.sources.workloads")


def harness_importers() -> set[str]:
    return {module for package in ("engine", "console")
            for module, targets in imports(package).items()
            if any(within(target, ("engine.harness",)) for target in targets)}


def test_only_the_twin_and_the_workload_commands_import_the_harness() -> None:
    importers = harness_importers()
    others = {module for module in importers if module not in RUN_WORKLOADS
              and not within(module, ("engine.harness", "engine.sim"))}
    assert not others, f"runtime modules import engine.harness: {sorted(others)}"
    assert set(RUN_WORKLOADS) <= importers, "RUN_WORKLOADS names a module that no longer needs it"
