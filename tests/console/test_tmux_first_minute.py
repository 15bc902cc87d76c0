"""The first minute in a real terminal (tmux), the console started with only --db: the first
thing on screen is a word, then the splash with the engine's stages; then the four live panes
with moving numbers, the header's C* reading a number or "calibrating", never the
placeholder 1; and q quits cleanly. How soon the first word shows is a figure for
benchmarks, not a test: under a loaded suite no real-time bound holds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.console.terminal import (
    START_WITHIN_S,
    console_command,
    exiting,
    moving,
    new_session,
    quit_on_q,
    screen,
)

WIDTH = "220"
CSTAR = re.compile(r"C\* (\S+)")

pytestmark = [pytest.mark.slow,  # the console in a real terminal
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def test_first_minute_shows_a_word_the_stages_live_panes_and_a_real_cstar_then_quits(
        tmp_path: Path) -> None:
    socket = f"tokenflow-first-{os.getpid()}-{time.monotonic_ns()}"  # its own tmux server
    tmux = ["tmux", "-L", socket]
    exit_file = tmp_path / "exit_code"
    # stderr stays on the terminal: Textual draws there
    command = exiting(console_command(tmp_path / "first.db"), socket, exit_file)
    # wide enough that the header never drops C* for warnings a loaded machine raises
    new_session(tmux, "first", command, width=WIDTH)
    try:
        cstars: list[str] = []
        screens: list[str] = []
        live = False
        with screen(tmux, "first", tmp_path) as pane:
            for text in pane.frames(START_WITHIN_S):  # read each time the console draws
                if text.strip():
                    screens.append(text)
                cstars += CSTAR.findall(text)
                live = live or moving(text)
                if live and cstars:  # a frame may be missed: read on until C* was seen too
                    break
        assert screens, "nothing was ever drawn"
        assert any("tokenflow" in s for s in screens[:3]), screens[:3]
        assert live, f"no live panes with moving numbers within {START_WITHIN_S} s:\n{screens[-1]}"
        assert any("loading" in s or "calibrating" in s for s in screens), (
            "the splash never named a stage")
        assert cstars and all(c == "calibrating" or (c.isdigit() and c != "1")
                              for c in cstars), (cstars, screens[-1])
        quit_on_q(tmux, "first", exit_file)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
