"""The embedded console left running for `--minutes` in a real terminal (a detached tmux
session, 120x40), its engine paused with `p` and resumed with `p` again at irregular
intervals (pauses of 5-90 s). Every `--sample-s` it samples the RSS, open fds and threads
of the console process and of its engine child processes, and the store's size on disk, and
checks that the pane never shows a traceback or a failed source.

Prints one JSON object: the samples and a verdict (RSS and fds flat within `--tolerance`
after `--warmup-s`, no traceback, the console alive to the end and quitting on q). Exits 1
on any miss.

    python benchmarks/console_soak.py [--minutes 30] [--seed 38]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
BAD_TEXT = ("Traceback", "SOURCE FAILED")
PAUSE_S = (5.0, 90.0)  # how long each pause lasts
RUN_S = (10.0, 120.0)  # how long the engine runs between pauses
FLAT = ("console_rss", "console_fds", "engine_rss", "engine_fds")


def console_program() -> str:
    """This checkout's console, run from its root: an installed `tokenflow-console` script
    imports wherever the install points (an editable one, another checkout)."""
    return f"{sys.executable} -m console.cli.console"


def usage(processes: list[psutil.Process]) -> tuple[int, int, int]:
    """RSS bytes, open fds and threads summed over `processes` (gone ones count nothing)."""
    rss = fds = threads = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied), \
                process.oneshot():
            rss += process.memory_info().rss
            fds += process.num_fds()
            threads += process.num_threads()
    return rss, fds, threads


def store_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal"),
                                         db.with_name(db.name + "-shm")) if p.exists())


def find_console(shell: psutil.Process, within_s: float) -> psutil.Process:
    """The console: the pane shell's child, once it has started."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        children = shell.children()
        if children:
            return children[0]
        time.sleep(0.2)
    raise SystemExit(f"the console did not start within {within_s} s")


def growth(samples: list[dict[str, Any]], key: str) -> float:
    """How far the metric rose above its first value after the warm-up, as a fraction."""
    first = samples[0][key]
    return (max(s[key] for s in samples) - first) / first if first else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=38)
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        parser.error("tmux is not installed: apt-get install tmux")
    if args.minutes <= 0 or args.sample_s <= 0 or args.warmup_s < 0:
        parser.error("--minutes and --sample-s must be > 0, --warmup-s >= 0")
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="console-soak-"))
    db = workdir / "soak.db"
    socket = f"tokenflow-soak-{os.getpid()}"
    tmux = ["tmux", "-L", socket]
    # The shell outlives the console, so the pane keeps what the console last showed.
    command = (f"cd {ROOT} && {console_program()} --db {db}; echo console exited $?; "
               "sleep 600")
    subprocess.run([*tmux, "new-session", "-d", "-s", "soak", "-x", "120", "-y", "40",
                    command], check=True)
    samples: list[dict[str, Any]] = []
    toggles: list[dict[str, Any]] = []
    bad: list[str] = []
    alive = True
    quit_cleanly = False
    try:
        pane_pid = int(subprocess.run([*tmux, "display-message", "-p", "-t", "soak",
                                       "#{pane_pid}"], capture_output=True, text=True,
                                      check=True).stdout)
        console = find_console(psutil.Process(pane_pid), 60.0)
        start = time.monotonic()
        end = start + args.minutes * 60
        next_sample = start
        paused = False
        next_toggle = start + rng.uniform(5.0, 30.0)
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_toggle:
                subprocess.run([*tmux, "send-keys", "-t", "soak", "p"], check=True)
                paused = not paused
                toggles.append({"t_s": round(now - start, 1), "paused": paused})
                next_toggle = now + rng.uniform(*(PAUSE_S if paused else RUN_S))
            if now >= next_sample:
                engine = console.children(recursive=True) if console.is_running() else []
                c_rss, c_fds, c_threads = usage([console])
                e_rss, e_fds, e_threads = usage(engine)
                pane = subprocess.run([*tmux, "capture-pane", "-p", "-t", "soak"],
                                      capture_output=True, text=True).stdout
                bad += [f"{text} at {now - start:.0f} s:\n{pane}" for text in BAD_TEXT
                        if text in pane]
                alive = alive and console.is_running() and "console exited" not in pane
                samples.append({
                    "t_s": round(now - start, 1), "paused": paused,
                    "console_rss": c_rss, "console_fds": c_fds, "console_threads": c_threads,
                    "engine_pids": [p.pid for p in engine], "engine_rss": e_rss,
                    "engine_fds": e_fds, "engine_threads": e_threads,
                    "store_bytes": store_bytes(db),
                })
                if bad or not alive:
                    break
                next_sample += args.sample_s
            time.sleep(max(0.0, min(next_sample, next_toggle, end) - time.monotonic()))
        if alive:
            if paused:  # resume first, so q quits a running engine as an operator would
                subprocess.run([*tmux, "send-keys", "-t", "soak", "p"], check=True)
            subprocess.run([*tmux, "send-keys", "-t", "soak", "q"], check=True)
            # the console is the pane shell's child, not ours: its exit code is on the pane
            with contextlib.suppress(psutil.TimeoutExpired):
                console.wait(60)
            quit_cleanly = "console exited 0" in subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "soak"], capture_output=True,
                text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    steady = [s for s in samples if s["t_s"] >= args.warmup_s]
    growths = {key: round(growth(steady, key), 4) for key in FLAT} if steady else {}
    flat = bool(steady) and all(g <= args.tolerance for g in growths.values())
    ok = flat and not bad and alive and quit_cleanly
    print(json.dumps({
        "minutes": args.minutes, "seed": args.seed, "store": str(db), "toggles": toggles,
        "samples": samples,
        "verdict": {"ok": ok, "flat": flat, "growth_after_warmup": growths,
                    "tolerance": args.tolerance, "alive": alive, "quit_cleanly": quit_cleanly,
                    "bad_screens": bad},
    }, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
