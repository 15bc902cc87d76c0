"""Launch to numbers: `tokenflow-console --db NEW` in a real terminal (a detached tmux
session, 120x40), timed from the launch to each thing the screen shows: the first output,
the four Live panes, and the panes with traffic flowing (tok/s above 0) while the first
calibration still runs. Then `q` quits it, and a second launch is sent `q` at `--quit-at-s`
(the splash or the first seconds of the panes) to check that it exits with status 0.

Every wait is on the screen's own writes (tests/console/terminal.py), never a polling pause.
The default store and the default calibration cache point into a temporary directory, so
the first calibration runs as it does for a newcomer (the compiled CPU kernels stay cached).

Prints one JSON object: each run's seconds, the load average before it, and the quit runs'
exit statuses. Exits 1 when a run missed `--within-s` or a quit did not exit with 0.

    python benchmarks/console_first_numbers.py [--runs 3] [--within-s 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.console.terminal, read from this checkout

from tests.console.terminal import screen  # noqa: E402

PANES = ("Requests", "Chunk queue", "Cache pressure", "Bandwidth")
TOKENS_PER_S = re.compile(r"([\d,]+) tok/s")
CAP_S = 180.0  # a broken start fails instead of hanging
EXIT_WITHIN_S = 30.0


def console_command(db: Path, exit_file: Path, socket: str) -> str:
    # -m from the checkout's root: this checkout's console, whichever one the venv installed
    return (f"cd {ROOT} && {sys.executable} -m console.cli.console --db {db}; "
            f"echo $? > {exit_file}; "
            f"tmux -L {socket} wait-for -S exited")


def start(socket: str, command: str, env: dict[str, str]) -> tuple[list[str], float]:
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    launched = time.monotonic()
    subprocess.run([*tmux, "new-session", "-d", "-s", "first", "-x", "120", "-y", "40",
                    command], check=True, env=env)
    subprocess.run([*tmux, "set-option", "-t", "first", "window-size", "manual"], check=True)
    subprocess.run([*tmux, "resize-window", "-t", "first", "-x", "120", "-y", "40"], check=True)
    return tmux, launched


def quit_and_wait(tmux: list[str], exit_file: Path) -> tuple[str | None, float]:
    """Send q; the exit status and the seconds until the console had exited."""
    sent = time.monotonic()
    subprocess.run([*tmux, "send-keys", "-t", "first", "q"], check=True)
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([*tmux, "wait-for", "exited"], capture_output=True,
                       timeout=EXIT_WITHIN_S)
    code = exit_file.read_text().strip() if exit_file.exists() else None
    return code, time.monotonic() - sent


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def one_launch(directory: Path, env: dict[str, str], run: int) -> dict[str, Any]:
    socket = f"tokenflow-numbers-{os.getpid()}-{run}"
    exit_file = directory / f"exit-{run}"
    tmux, launched = start(socket, console_command(directory / f"new-{run}.db", exit_file,
                                                   socket), env)
    seen: dict[str, Any] = {}
    header = ""
    pipes = directory / f"pipe-{run}"
    pipes.mkdir()
    try:
        with screen(tmux, "first", pipes) as pane:
            for text in pane.frames(CAP_S):
                at = round(time.monotonic() - launched, 2)
                if text.strip():
                    seen.setdefault("first_output_s", at)
                if all(p in text for p in PANES):
                    seen.setdefault("panes_s", at)
                    rate = TOKENS_PER_S.search(text)
                    if rate and int(rate[1].replace(",", "")) > 0:
                        seen["numbers_s"] = at
                        header = text.splitlines()[0] if text else ""
                        break
        seen["calibrating_at_numbers"] = "calibrating" in header
        seen["exit_status"], exit_s = quit_and_wait(tmux, exit_file)
        seen["exit_s"] = round(exit_s, 2)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    return seen


def quit_early(directory: Path, env: dict[str, str], at_s: float) -> dict[str, Any]:
    """A launch sent q `at_s` after it began (by the clock: the point is the moment)."""
    socket = f"tokenflow-quit-{os.getpid()}"
    exit_file = directory / "exit-quit"
    tmux, launched = start(socket, console_command(directory / "quit.db", exit_file, socket),
                           env)
    try:
        time.sleep(max(0.0, launched + at_s - time.monotonic()))
        code, exit_s = quit_and_wait(tmux, exit_file)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    return {"q_at_s": at_s, "exit_status": code, "exit_s": round(exit_s, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--within-s", type=float, default=10.0)
    parser.add_argument("--quit-at-s", type=float, default=3.0)
    parser.add_argument("--busy", type=int, default=0,
                        help="processes spinning on a core each throughout, to time a "
                             "launch on a loaded machine (default 0)")
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    try:
        return measure(args)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def measure(args: argparse.Namespace) -> int:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tokenflow-numbers-") as name:
        directory = Path(name)
        # no stored calibration to reuse: every launch runs the first one
        env = {**os.environ, "XDG_DATA_HOME": str(directory / "data")}
        for run in range(args.runs):
            before = load()
            runs.append({"load_before": before, **one_launch(directory, env, run)})
        quit = {"load_before": load(), **quit_early(directory, env, args.quit_at_s)}
    missed = [r for r in runs if r.get("numbers_s", CAP_S) > args.within_s
              or r.get("exit_status") != "0"]
    print(json.dumps({"runs": runs, "quit": quit, "within_s": args.within_s,
                      "busy": args.busy,
                      "ok": not missed and quit["exit_status"] == "0"}, indent=2))
    return 0 if not missed and quit["exit_status"] == "0" else 1


if __name__ == "__main__":
    sys.exit(main())
