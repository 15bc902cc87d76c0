"""A newcomer's first hour in a real terminal (tmux): the console starts on a new store, the
splash ends, screen keys typed at speed switch screens and never type into a field, help
opens and closes, and at 80x24 no line wraps to the pane's edge and the header keeps the
source's name. Every wait is on what the screen shows (tests/console/terminal.py), and the
store shows afterwards that no setting was changed."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.store import config_changes, open_database
from tests.console.terminal import Screen, new_session, resize, screen, send_keys
from tests.console.test_tmux_smoke import PANES, console_command

# Hang guards, not speed targets: each wait ends on what the screen shows.
START_WITHIN_S = 120.0
SHOWN_WITHIN_S = 30.0
EXIT_WITHIN_S = 60.0
SOURCE = "embedded synthetic:tiny on cpu"
BUDGET = re.compile(r"Token budget\s+(\d+)")
# Diagnosis's findings hang under their first words: a line at the pane's edge starts a
# finding (or is the summary), never a wrapped sentence's next words
FINDING_STARTS = ("● ", "○ ", "1", "2", "3", "4", "5", "6", "7", "8", "0")


def wrapped_to_the_edge(text: str) -> list[str]:
    return [line for line in text.splitlines()[2:-2]
            if re.match(r"│ \S", line) and not line[2:].startswith(FINDING_STARTS)]


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def wait_for(pane: Screen, seen: Callable[[str], bool], what: str,
             within_s: float = SHOWN_WITHIN_S) -> str:
    text = ""
    for text in pane.frames(within_s):
        if seen(text):
            return text
    raise AssertionError(f"{what} not shown within {within_s} s:\n{text}")


def live(text: str) -> bool:
    return all(p in text for p in PANES) and "Live configuration" not in text


def tuning(text: str) -> bool:
    return BUDGET.search(text) is not None


def test_the_first_hour_keys_never_type_into_a_field(tmp_path: Path) -> None:
    socket = f"tokenflow-hour-{os.getpid()}-{time.monotonic_ns()}"
    tmux = ["tmux", "-L", socket]
    db = tmp_path / "first.db"
    exit_file = tmp_path / "exit_code"
    command = (f"{console_command(db)} --model synthetic:tiny --device cpu; "
               f"echo $? > {exit_file}; tmux -L {socket} wait-for -S exited")
    new_session(tmux, "hour", command)
    keys = functools.partial(send_keys, tmux, "hour")

    try:
        with screen(tmux, "hour", tmp_path) as pane:
            wait_for(pane, live, "the live panes (the splash ended)", START_WITHIN_S)
            keys("2")
            budget = BUDGET.search(wait_for(pane, tuning, "Tuning"))
            assert budget is not None
            keys("2", "3", "1")
            wait_for(pane, live, "Live after 2 3 1")
            keys("2")
            text = wait_for(pane, tuning, "Tuning again")
            assert BUDGET.search(text)[1] == budget[1], "a screen key typed into the budget"
            keys("Escape", "5")
            wait_for(pane, lambda t: "Diagnosis:" in t, "Diagnosis")
            keys("?")
            wait_for(pane, lambda t: "keys and glossary" in t, "help")
            keys("Escape")
            wait_for(pane, lambda t: "keys and glossary" not in t and "Diagnosis:" in t,
                     "help closed")

            resize(tmux, "hour", 80, 24)
            for key, shown in (("5", "Diagnosis:"), ("2", "Live configuration"),
                               ("1", "Requests"), ("4", "Drift")):
                keys(key)
                text = wait_for(pane, lambda t, s=shown: s in t and max(
                    len(line) for line in t.splitlines()) <= 80, f"{shown} at 80x24")
                lines = text.splitlines()
                assert SOURCE in lines[0], f"the header lost the source's name:\n{text}"
                if shown == "Diagnosis:":
                    edge = wrapped_to_the_edge(text)
                    assert not edge, f"lines wrapped to the pane's edge:\n{text}"
            keys("q")
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([*tmux, "wait-for", "exited"], capture_output=True,
                           timeout=EXIT_WITHIN_S)
        assert exit_file.exists() and exit_file.read_text().strip() == "0"
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    database = open_database(db, read_only=True)
    try:
        with database.session() as session:
            changed = [c for c in config_changes(session) if c.source == "console"]
    finally:
        database.close()
    assert not changed, f"a screen key changed {[(c.field, c.new) for c in changed]}"
