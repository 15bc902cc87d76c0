"""The screen of a program running in a tmux pane, read when the program draws.

tmux's `pipe-pane` copies everything the program writes to its pane into a FIFO; the test
blocks on that FIFO and reads the rendered screen (`capture-pane`) after each write, so it
waits on the program's own output, not on a fixed polling pause.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

READ_BYTES = 1 << 16
ROOT = Path(__file__).resolve().parents[2]
PANES = ("Requests", "Chunk queue", "Cache pressure", "Bandwidth")
TOKENS_PER_S = re.compile(r"([\d,]+) tok/s")
# Hang guards, not speed targets: each wait ends on what the screen shows (a loaded machine
# once took ~13 s to the first live screen). Speed is for benchmarks.
START_WITHIN_S = 120.0
SHOWN_WITHIN_S = 30.0
EXIT_WITHIN_S = 60.0


def console_command(db: Path) -> str:
    """The shell command that starts the console on `db`, as a user would."""
    script = ROOT / ".venv" / "bin" / "tokenflow-console"
    program = str(script) if script.exists() else f"{sys.executable} -m console.cli.console"
    return f"cd {ROOT} && {program} --db {db}"


class Screen:
    """The pane `target` of the tmux server `tmux` (its argv prefix)."""

    def __init__(self, tmux: list[str], target: str, fifo: int) -> None:
        self.tmux = tmux
        self.target = target
        self._fifo = fifo
        self._closed = False

    def text(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", self.target],
                              capture_output=True, text=True).stdout

    def frames(self, within_s: float) -> Iterator[str]:
        """The screen now, then again after every write to the pane, until `within_s` has
        passed or the pane's program has gone."""
        deadline = time.monotonic() + within_s
        yield self.text()
        while not self._closed and (left := deadline - time.monotonic()) > 0:
            if not select.select([self._fifo], [], [], left)[0]:
                return  # nothing drawn before the deadline
            if not os.read(self._fifo, READ_BYTES):
                self._closed = True  # the pane's program (and its pipe) ended
            yield self.text()


def wait_for(pane: Screen, seen: Callable[[str], bool], what: str,
             within_s: float = SHOWN_WITHIN_S) -> str:
    """The first screen of `pane` that `seen` accepts, read each time the program draws."""
    text = ""
    for text in pane.frames(within_s):
        if seen(text):
            return text
    raise AssertionError(f"{what} not shown within {within_s} s:\n{text}")


@contextmanager
def screen(tmux: list[str], target: str, directory: Path) -> Iterator[Screen]:
    """A Screen of `target`, piped through a FIFO in `directory` for the `with` block."""
    fifo = directory / f"{target}.pane"
    os.mkfifo(fifo)
    # non-blocking open: a FIFO's reader may open before its writer exists
    descriptor = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        subprocess.run([*tmux, "pipe-pane", "-t", target, f"cat >> {fifo}"], check=True)
        yield Screen(tmux, target, descriptor)
    finally:
        os.close(descriptor)


def new_session(tmux: list[str], name: str, command: str, width: int | str = 120,
                height: int | str = 40) -> None:
    """Run `command` in a detached session `name` of exactly `width` x `height`. A detached
    session may start at tmux's default size (80x24) and a program resized before it listens
    for SIGWINCH keeps drawing at its first size, so a placeholder holds the pane while it is
    sized by hand, and then `command` replaces it at its final size."""
    # No COLUMNS or LINES: readline, once an import initialises it, exports 80 and 24 into
    # the process's C environment, and a console in the pane would read that size
    # (shutil.get_terminal_size) at start and at every resize
    sized = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    subprocess.run([*tmux, "new-session", "-d", "-s", name, "-x", str(width), "-y", str(height),
                    "cat"], check=True, env=sized)
    subprocess.run([*tmux, "set-option", "-t", name, "window-size", "manual"], check=True)
    resize(tmux, name, width, height)
    subprocess.run([*tmux, "respawn-pane", "-k", "-t", name, command], check=True)


def resize(tmux: list[str], name: str, width: int | str, height: int | str) -> None:
    subprocess.run([*tmux, "resize-window", "-t", name, "-x", str(width), "-y", str(height)],
                   check=True)


def send_keys(tmux: list[str], name: str, *keys: str) -> None:
    """One send-keys: the keys arrive at once, at speed."""
    subprocess.run([*tmux, "send-keys", "-t", name, *keys], check=True)


def exiting(command: str, socket: str, exit_file: Path) -> str:
    """`command`, then its exit code into `exit_file` and a signal on the tmux channel
    "exited" (of the server `socket`), so a test waits on that event, not on the file."""
    return f"{command}; echo $? > {exit_file}; tmux -L {socket} wait-for -S exited"


def quit_on_q(tmux: list[str], name: str, exit_file: Path) -> None:
    """Press q in session `name` (started with `exiting`): the console exits with 0."""
    send_keys(tmux, name, "q")
    # Returns when signalled (or when the server has gone with the finished session);
    # tmux remembers a signal sent before anyone waits.
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([*tmux, "wait-for", "exited"], capture_output=True,
                       timeout=EXIT_WITHIN_S)
    assert exit_file.exists(), "the console did not exit on q"
    assert exit_file.read_text().strip() == "0"
