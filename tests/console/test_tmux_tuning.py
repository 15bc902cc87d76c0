"""A tuning session in a real terminal (tmux) beside a busy loop on one core: edits sent as
one burst of keys (Tab, digits, Backspaces, Enter or ctrl+s, then a screen key) land in the
order sent, each Apply ends the edit so the next digit switches screens, and the form works
at 80x24. The store shows exactly the changes typed, and the screen what was applied. Every
wait is on what the screen shows (tests/console/terminal.py)."""

from __future__ import annotations

import contextlib
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
from tests.console.terminal import new_session, resize, screen, send_keys
from tests.console.test_tmux_first_hour import (
    EXIT_WITHIN_S,
    START_WITHIN_S,
    live,
    tuning,
    wait_for,
)
from tests.console.test_tmux_smoke import console_command

BUDGET = re.compile(r"Token budget\s+(\d+)")
SLOW_QUERIES = "prefill ms"  # a column of the Slow queries table alone

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def budget_is(value: int, width: int = 120):
    def seen(text: str) -> bool:
        found = BUDGET.search(text)
        return (found is not None and found[1] == str(value) and "Live configuration" in text
                and max(len(line) for line in text.splitlines()) <= width)
    return seen


def test_a_tuning_session_at_speed_beside_a_busy_core(tmp_path: Path) -> None:
    socket = f"tokenflow-tune-{os.getpid()}-{time.monotonic_ns()}"
    tmux = ["tmux", "-L", socket]
    db = tmp_path / "tuning.db"
    exit_file = tmp_path / "exit_code"
    command = (f"{console_command(db)} --model synthetic:tiny --device cpu; "
               f"echo $? > {exit_file}; tmux -L {socket} wait-for -S exited")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    new_session(tmux, "tune", command)
    keys = functools.partial(send_keys, tmux, "tune")

    try:
        with screen(tmux, "tune", tmp_path) as pane:
            wait_for(pane, live, "the live panes (the splash ended)", START_WITHIN_S)
            keys("2")
            wait_for(pane, tuning, "Tuning")
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

            resize(tmux, "tune", 80, 24)
            wait_for(pane, budget_is(512, width=80), "the form at 80x24")
            keys("Tab", "Tab", "6", "4", "0", "Enter", "4")
            wait_for(pane, lambda t: "Calibration history" in t, "Drift at 80x24")
            keys("2")
            wait_for(pane, budget_is(640, width=80), "the budget applied at 640")
            keys("q")
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([*tmux, "wait-for", "exited"], capture_output=True,
                           timeout=EXIT_WITHIN_S)
        assert exit_file.exists() and exit_file.read_text().strip() == "0"
    finally:
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
    assert changed == [("max_num_batched_tokens", 384), ("max_num_batched_tokens", 512),
                       ("max_num_batched_tokens", 640)]
