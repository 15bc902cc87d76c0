"""What an idle console costs: the embedded console in a real terminal (a detached tmux
session, 120x40) on traffic so sparse (`--rate 0.001`: one request, then none for minutes)
that the engine is idle once it has served the first, on the Live screen; then its engine
paused with `p`. Over `--seconds` in each state it measures the CPU time of the console
process and of its engine child processes, as a share of one core.

Prints one JSON object per state; exits 1 when the console's share is above `--target`.

    python benchmarks/console_idle.py [--seconds 60] [--states idle,paused]
        [--model synthetic:tiny] [--target 0.03] [--root CHECKOUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SHOWN_WITHIN_S = 180.0  # a hang guard: every wait ends on what the pane shows


class Pane:
    def __init__(self, tmux: list[str], target: str) -> None:
        self.tmux, self.target = tmux, target

    def text(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", self.target],
                              capture_output=True, text=True).stdout

    def keys(self, *keys: str) -> None:
        for key in keys:  # one at a time: each is a key name or one character
            subprocess.run([*self.tmux, "send-keys", "-t", self.target, key], check=True)

    def wait(self, seen: Callable[[str], bool], what: str) -> str:
        deadline = time.monotonic() + SHOWN_WITHIN_S
        text = ""
        while time.monotonic() < deadline:
            text = self.text()
            if seen(text):
                return text
            time.sleep(0.5)
        raise SystemExit(f"{what} not shown within {SHOWN_WITHIN_S} s:\n{text}")


def cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def measure(console: psutil.Process, seconds: float) -> dict[str, float]:
    engine = console.children(recursive=True)
    start = time.monotonic()
    c0, e0 = cpu_s([console]), cpu_s(engine)
    time.sleep(seconds)
    wall = time.monotonic() - start
    return {"console_core_share": round((cpu_s([console]) - c0) / wall, 4),
            "engine_core_share": round((cpu_s(engine) - e0) / wall, 4),
            "seconds": round(wall, 1), "load_1m": round(os.getloadavg()[0], 2)}


def idle(pane: Pane) -> None:
    pane.wait(lambda t: "0 running · 0 waiting" in t and "Requests" in t, "an empty engine")


def pause(pane: Pane) -> None:
    pane.keys("p")
    pane.wait(lambda t: "PAUSED" in t.upper() and "pausing" not in t, "the pause")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--states", default="idle,paused")
    parser.add_argument("--model", default="synthetic:tiny")
    parser.add_argument("--target", type=float, default=0.03)
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout whose console runs (another branch, for a before)")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        parser.error("tmux is not installed: apt-get install tmux")
    states = args.states.split(",")
    if args.seconds <= 0 or not set(states) <= {"idle", "paused"}:
        parser.error("--seconds must be > 0; --states takes idle and paused")
    workdir = Path(tempfile.mkdtemp(prefix="console-idle-"))
    socket = f"tokenflow-idle-{os.getpid()}"
    tmux = ["tmux", "-L", socket]
    command = (f"cd {args.root} && exec {sys.executable} -m console.cli.console --db "
               f"{workdir / 'idle.db'} --model {args.model} --rate 0.001")
    subprocess.run([*tmux, "new-session", "-d", "-s", "idle", "-x", "120", "-y", "40",
                    command], check=True)
    results = {}
    try:
        pane = Pane(tmux, "idle")
        pane.wait(lambda t: "Requests" in t and "tok/s" in t, "the Live screen")
        console = psutil.Process(int(subprocess.run(
            [*tmux, "display-message", "-p", "-t", "idle", "#{pane_pid}"],
            capture_output=True, text=True, check=True).stdout))
        for state in states:
            (idle if state == "idle" else pause)(pane)
            time.sleep(2.0)  # the last redraws of the change settle first
            results[state] = measure(console, args.seconds)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({"model": args.model, "target": args.target, **results}, indent=1))
    return 0 if all(r["console_core_share"] <= args.target for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
