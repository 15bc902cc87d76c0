"""docs/architecture.md against the tree: every file and folder it names is where it says, and
every folder of engine/ and console/ that holds Python is in its tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# A path-like word: a file with one of these endings, or a folder (a trailing slash); a word
# running on after a slash ("scheduler/runner") is prose.
PATH = re.compile(r"(?<![\w./-])([\w-]+(?:/[\w-]+)*(?:\.(?:py|cpp|h|tcss|md|csv)|/))(?![\w/])")
FOLDER_LINE = re.compile(r"^( *)([\w-]+/)(?:\s|$)")


def tree_block(text: str) -> list[str]:
    """The lines of the doc's first fenced block: the tree."""
    found = re.search(r"^```\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert found, "docs/architecture.md has no fenced tree"
    return found[1].splitlines()


def tree_paths(lines: list[str]) -> tuple[set[Path], set[Path]]:
    """(every path the tree names, the folders it lists as entries), resolved by indentation: a
    folder line opens a folder under the nearest less indented one; every other line (a list of
    files, a description running on) names paths inside the folder it sits under."""
    named: set[Path] = set()
    folders: set[Path] = set()
    open_folders: list[tuple[int, Path]] = []
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        while open_folders and open_folders[-1][0] >= indent:
            open_folders.pop()
        here = open_folders[-1][1] if open_folders else ROOT
        rest = line
        folder = FOLDER_LINE.match(line)
        if folder:
            here = here / folder[2]
            folders.add(here)
            open_folders.append((indent, here))
            rest = line[folder.end():]
        named.update(here / word for word in PATH.findall(rest))
    return named | folders, folders


def prose_paths(text: str) -> set[Path]:
    """Paths the prose outside the tree names in backticks, from the repository root."""
    outside = re.sub(r"^```\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return {ROOT / word for quoted in re.findall(r"`([^`]+)`", outside)
            for word in PATH.findall(quoted) if "/" in word}


def test_every_path_the_architecture_names_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    named, _ = tree_paths(tree_block(text))
    missing = sorted(str(p.relative_to(ROOT)) for p in named | prose_paths(text) if not p.exists())
    assert not missing, f"docs/architecture.md names paths that are not there: {missing}"


def test_every_engine_and_console_folder_is_in_the_tree() -> None:
    named, _ = tree_paths(tree_block(DOC.read_text(encoding="utf-8")))
    listed = {p.resolve() for p in named}
    unlisted = sorted(
        str(folder.relative_to(ROOT))
        for top in ("engine", "console") for folder in [ROOT / top, *(ROOT / top).rglob("*")]
        if folder.is_dir() and "__pycache__" not in folder.parts and any(folder.glob("*.py"))
        and folder.resolve() not in listed)
    assert not unlisted, f"docs/architecture.md's tree leaves out {unlisted}"


def test_the_tree_reader_resolves_by_indentation() -> None:
    named, folders = tree_paths(["engine/   x", "  core/   scheduler.py,",
                                 "           engine_core.py: the scheduler/runner loop",
                                 "  config.py", "docs/"])
    assert folders == {ROOT / "engine/", ROOT / "engine/core/", ROOT / "docs/"}
    assert named == folders | {ROOT / "engine/core/scheduler.py",
                               ROOT / "engine/core/engine_core.py",
                               ROOT / "engine/config.py"}
