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

from tests.console.terminal import screen
from tests.console.test_tmux_smoke import TOKENS_PER_S, console_command

VISIBLE_WITHIN_S = 2.0  # something on screen this soon after launch, read from the screen
LIVE_CAP_S = 120.0  # a generous cap on waiting for the engine, so a broken start fails
CSTAR = re.compile(r"C\* (\S+)")

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def test_first_minute_shows_progress_at_once_and_a_real_cstar(tmp_path: Path) -> None:
    socket = f"tokenflow-first-{os.getpid()}-{time.monotonic_ns()}"
    tmux = ["tmux", "-L", socket]
    command = f"{console_command(tmp_path / 'first.db')} --model synthetic:tiny"
    started = time.monotonic()
    subprocess.run([*tmux, "new-session", "-d", "-s", "first", "-x", "120", "-y", "40",
                    command], check=True)
    # a detached session falls back to tmux's default size (80x24) unless sized by hand
    subprocess.run([*tmux, "set-option", "-t", "first", "window-size", "manual"], check=True)
    subprocess.run([*tmux, "resize-window", "-t", "first", "-x", "120", "-y", "40"], check=True)
    try:
        first_seen = None
        cstars: list[str] = []
        screens: list[str] = []
        live = False
        with screen(tmux, "first", tmp_path) as pane:
            for text in pane.frames(LIVE_CAP_S):  # read each time the console draws
                if first_seen is None and text.strip():
                    first_seen = time.monotonic() - started
                screens.append(text)
                cstars += CSTAR.findall(text)
                rate = TOKENS_PER_S.search(text)
                if rate and int(rate[1].replace(",", "")) > 0:
                    live = True
                    break
        assert first_seen is not None and first_seen <= VISIBLE_WITHIN_S, (
            f"first output after {first_seen} s")
        assert any("tokenflow" in s for s in screens[:3]), screens[:3]
        assert live, f"not live within {LIVE_CAP_S} s:\n{screens[-1]}"
        assert any("loading" in s or "calibrating" in s for s in screens), (
            "the splash never named a stage")
        assert cstars and all(c == "calibrating" or (c.isdigit() and c != "1")
                              for c in cstars), (cstars, screens[-1])
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
