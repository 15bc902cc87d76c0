"""The README is an entry point: its two commands come first, and it stays short."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_opens_with_its_two_commands_and_stays_short() -> None:
    lines = README.read_text().splitlines()
    head = "\n".join(lines[:15])
    assert "./scripts/console" in head and "./scripts/test" in head
    assert len(lines) < 250
