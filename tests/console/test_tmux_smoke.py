"""A real terminal: the console under tmux, started with only --db, shows the four live panes
with moving numbers and quits cleanly on q."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.console.terminal import (
    EXIT_WITHIN_S,
    PANES,
    START_WITHIN_S,
    TOKENS_PER_S,
    console_command,
    new_session,
    screen,
)

pytestmark = [pytest.mark.slow,  # the console in a real terminal
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def test_console_under_tmux_goes_live_and_quits_on_q(tmp_path: Path) -> None:
    socket = f"tokenflow-smoke-{os.getpid()}-{time.monotonic_ns()}"  # its own tmux server
    exit_file = tmp_path / "exit_code"
    tmux = ["tmux", "-L", socket]
    # stderr stays on the terminal: Textual draws there. On exit the command signals a tmux
    # channel, so the test waits on that event rather than polling for the exit file.
    command = (f"{console_command(tmp_path / 'smoke.db')}; echo $? > {exit_file}; "
               f"tmux -L {socket} wait-for -S exited")
    new_session(tmux, "smoke", command, width=120, height=40)
    try:
        text = ""
        live = False
        with screen(tmux, "smoke", tmp_path) as pane:
            for text in pane.frames(START_WITHIN_S):  # read each time the console draws
                rate = TOKENS_PER_S.search(text)
                if all(p in text for p in PANES) and rate and int(rate[1].replace(",", "")):
                    live = True
                    break
        assert live, f"no live panes after {START_WITHIN_S} s:\n{text}"

        subprocess.run([*tmux, "send-keys", "-t", "smoke", "q"], check=True)
        # Returns when signalled (or when the server has gone with the finished session);
        # tmux remembers a signal sent before anyone waits.
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([*tmux, "wait-for", "exited"], capture_output=True,
                           timeout=EXIT_WITHIN_S)
        assert exit_file.exists(), "the console did not exit on q"
        assert exit_file.read_text().strip() == "0"
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
