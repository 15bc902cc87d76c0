"""The first minute in a real terminal: something is on screen within 2 s of launch (a word,
then the splash with the engine's stages), and the header's C* reads a number or
"calibrating", never the placeholder 1."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.console.test_tmux_smoke import TOKENS_PER_S, console_command

VISIBLE_WITHIN_S = 2.0  # the bound, measured on the screen's content
LIVE_CAP_S = 120.0  # a generous cap on waiting for the engine, so a broken start fails
POLL_S = 0.1
CSTAR = re.compile(r"C\* (\S+)")

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def test_first_minute_shows_progress_at_once_and_a_real_cstar(tmp_path: Path) -> None:
    socket = f"tokenflow-first-{os.getpid()}-{time.monotonic_ns()}"
    tmux = ["tmux", "-L", socket]
    command = f"{console_command(tmp_path / 'first.db')} --model synthetic:tiny"
    started = time.monotonic()
    subprocess.run([*tmux, "new-session", "-d", "-s", "first", "-x", "120", "-y", "40",
                    command], check=True)
    try:
        first_seen = None
        cstars: list[str] = []
        screens: list[str] = []
        live = False
        # Another process's screen has no event to wait on: it is read every POLL_S.
        while time.monotonic() - started < LIVE_CAP_S:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "first"],
                                    capture_output=True, text=True).stdout
            if first_seen is None and screen.strip():
                first_seen = time.monotonic() - started
            screens.append(screen)
            cstars += CSTAR.findall(screen)
            rate = TOKENS_PER_S.search(screen)
            if rate and int(rate[1].replace(",", "")) > 0:
                live = True
                break
            time.sleep(POLL_S)
        assert first_seen is not None and first_seen <= VISIBLE_WITHIN_S, (
            f"first output after {first_seen} s")
        assert any("tokenflow" in s for s in screens[:3]), screens[:3]
        assert live, f"not live within {LIVE_CAP_S} s:\n{screens[-1]}"
        assert any("loading" in s or "calibrating" in s for s in screens), (
            "the splash never named a stage")
        assert cstars and all(c == "calibrating" or (c.isdigit() and c != "1")
                              for c in cstars), cstars
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
