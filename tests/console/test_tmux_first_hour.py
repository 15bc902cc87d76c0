"""A newcomer's first hour in a real terminal (tmux), every wait on what the screen shows
(tests/console/terminal.py):

- the console starts on a new store and the splash ends; screen keys typed at speed switch
  screens and never type into a field; help opens and closes; at 80x24 no line wraps to the
  pane's edge and the header keeps the source's name;
- then a tuning session beside a busy loop on one core: edits sent as one burst of keys
  (Tab, digits, Backspaces, Enter or ctrl+s, then a screen key) land in the order sent, each
  Apply ends the edit so the next digit switches screens, and the form works at 80x24.

The store shows exactly the changes typed (no screen key changed a setting), and the screen
what was applied."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.store import config_changes, open_database
from tests.console.terminal import (
    PANES,
    START_WITHIN_S,
    console_command,
    exiting,
    new_session,
    quit_on_q,
    resize,
    screen,
    send_keys,
    wait_for,
)

SOURCE = "embedded synthetic:tiny on cpu"
BUDGET = re.compile(r"Token budget\s+(\d+)")
SLOW_QUERIES = "prefill ms"  # a column of the Slow queries table alone
# Diagnosis's findings hang under their first words: a line at the pane's edge starts a
# finding (or is the summary), never a wrapped sentence's next words
FINDING_STARTS = ("● ", "○ ", "1", "2", "3", "4", "5", "6", "7", "8", "0")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def wrapped_to_the_edge(text: str) -> list[str]:
    return [line for line in text.splitlines()[2:-2]
            if re.match(r"│ \S", line) and not line[2:].startswith(FINDING_STARTS)]


def live(text: str) -> bool:
    return all(p in text for p in PANES) and "Live configuration" not in text


def tuning(text: str) -> bool:
    return BUDGET.search(text) is not None


def drawn_at(text: str, width: int) -> bool:
    """Whether the console drew `text` at `width` columns. Just after a resize the pane shows
    the old picture cut to the new width until the console redraws: the header then lacks
    its last part, the source's name, which a header drawn at the width keeps."""
    lines = text.splitlines()
    return bool(lines) and SOURCE in lines[0] and max(len(line) for line in lines) <= width


def budget_is(value: int, width: int = 120):
    def seen(text: str) -> bool:
        found = BUDGET.search(text)
        return (found is not None and found[1] == str(value) and "Live configuration" in text
                and drawn_at(text, width))
    return seen


def test_the_first_hour_keys_never_type_into_a_field_and_tuning_bursts_land_in_order(
        tmp_path: Path) -> None:
    socket = f"tokenflow-hour-{os.getpid()}-{time.monotonic_ns()}"
    tmux = ["tmux", "-L", socket]
    db = tmp_path / "first.db"
    exit_file = tmp_path / "exit_code"
    # a trickle of traffic: no screen it waits on needs more, and an engine stepping
    # endless traffic would spend every wait of the test on it
    command = exiting(f"{console_command(db)} --model synthetic:tiny --device cpu --rate 0.5",
                      socket, exit_file)
    new_session(tmux, "hour", command)
    keys = functools.partial(send_keys, tmux, "hour")
    hog: subprocess.Popen[bytes] | None = None

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
                # a header that lost the source's name at 80x24 never passes this wait
                text = wait_for(pane, lambda t, s=shown: s in t and drawn_at(t, 80),
                                f"{shown} at 80x24, the header keeping the source's name")
                if shown == "Diagnosis:":
                    edge = wrapped_to_the_edge(text)
                    assert not edge, f"lines wrapped to the pane's edge:\n{text}"

            # the tuning session, beside a busy loop on one core, back at 120x40
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            resize(tmux, "hour", 120, 40)
            keys("2")
            wait_for(pane, budget_is(int(budget[1])), "Tuning at 120x40")
            # Tab twice: the budget, its value selected; 424, three Backspaces, 384, Enter
            # applies; 3 is a screen key again
            keys("Tab", "Tab", "4", "2", "4", "BSpace", "BSpace", "BSpace", "3", "8", "4",
                 "Enter", "3")
            wait_for(pane, lambda t: SLOW_QUERIES in t and "Live configuration" not in t,
                     "Slow queries after Enter and 3")
            keys("2")
            wait_for(pane, budget_is(384), "the budget applied at 384")
            # a Backspace burst past the value's start, then ctrl+s and 1
            keys("Tab", "Tab", "End", *["BSpace"] * 6, "5", "1", "2", "C-s", "1")
            wait_for(pane, live, "Live after ctrl+s and 1")
            keys("2")
            wait_for(pane, budget_is(512), "the budget applied at 512")

            resize(tmux, "hour", 80, 24)
            wait_for(pane, budget_is(512, width=80), "the form at 80x24")
            keys("Tab", "Tab", "6", "4", "0", "Enter", "4")
            wait_for(pane, lambda t: "Calibration history" in t, "Drift at 80x24")
            keys("2")
            wait_for(pane, budget_is(640, width=80), "the budget applied at 640")
        quit_on_q(tmux, "hour", exit_file)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    database = open_database(db, read_only=True)
    try:
        with database.session() as session:
            changed = [(c.field, c.new) for c in reversed(config_changes(session))
                       if c.source == "console"]
    finally:
        database.close()
    # the first hour's screen keys changed nothing; the tuning bursts, exactly what they typed
    assert changed == [("max_num_batched_tokens", 384), ("max_num_batched_tokens", 512),
                       ("max_num_batched_tokens", 640)]
