"""Input latency of the console in a real terminal beside busy loops: the embedded console
(synthetic:tiny, its default traffic) in a detached tmux pane at 120x40, with `--hogs` busy
loops running; the screen keys 2 and 1 are pressed in turn `--presses` times, and each time
the wait from the key's send to the first frame that shows the new screen is taken. Frames
are read as the console writes them to its pane (tmux pipe-pane into a FIFO): the wait ends
when the new screen's title is among the bytes written since the key, and the pane is then
checked to show that screen and not the old one. The figure is the key's round trip through
tmux, the console and its redraw, with no polling of the pane inside it.

The console's own CPU time (its process, not the engine's) is read before and after the
presses; less its idle rate over the seconds before them, it gives the CPU a press costs,
which a loaded machine changes far less than it changes the waits. Its UI thread's CPU time
from each key's send to its frame, less that thread's idle rate over the same wait, is the
CPU the console spent to answer the key (`ui_cpu_ms_to_frame`); the longer waits of a
loaded machine add only the idle work inside them, which is taken off.

Prints one JSON object: median, p90 and max in ms, CPU ms per press, the UI thread's CPU ms
from key to frame (mean), the console's idle CPU share of one core, and the load average.

    python benchmarks/console_keys.py [--presses 20] [--hogs 2] [--root CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOWN_WITHIN_S = 180.0  # a hang guard
SETTLE_S = 3.0  # past the start-up's first redraws
IDLE_S = 4.0  # the console's idle CPU rate is read over this long before the presses


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User plus system CPU time of process `pid` (its threads, not its children), or of
    its `thread` alone."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Frames(threading.Thread):
    """What the console writes to its pane, read as it comes (a FIFO left unread would hold
    tmux and the console back), with the time each piece arrived."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.pieces: list[tuple[float, bytes]] = []
        self.arrived = threading.Condition()

    def run(self) -> None:
        while True:
            select.select([self.fd], [], [], 1.0)
            try:
                piece = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                return
            if piece:
                with self.arrived:
                    self.pieces.append((time.monotonic(), piece))
                    self.arrived.notify_all()

    def mark(self) -> int:
        with self.arrived:
            return len(self.pieces)

    def wait(self, timeout: float) -> None:
        with self.arrived:
            self.arrived.wait(timeout)

    def until(self, text: bytes, since: int, deadline: float) -> float | None:
        """When `text` was first among the pieces written from `since` on (None: not by
        `deadline`); the search overlaps piece boundaries."""
        with self.arrived:
            seen = b""
            while time.monotonic() < deadline:
                while since < len(self.pieces):
                    at, piece = self.pieces[since]
                    since += 1
                    seen = seen[-len(text):] + piece
                    if text in seen:
                        return at
                self.arrived.wait(1.0)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presses", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        parser.error("tmux is not installed: apt-get install tmux")
    workdir = Path(tempfile.mkdtemp(prefix="console-keys-"))
    tmux = ["tmux", "-L", f"tokenflow-keys-{os.getpid()}"]
    command = (f"cd {args.root} && exec {sys.executable} -m console.cli.console --db "
               f"{workdir / 'keys.db'} --model synthetic:tiny")
    subprocess.run([*tmux, "new-session", "-d", "-s", "keys", "-x", "120", "-y", "40", command],
                   check=True)
    fifo = workdir / "pane"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    subprocess.run([*tmux, "pipe-pane", "-t", "keys", f"cat >> {fifo}"], check=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hogs)]

    def text() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", "keys"],
                              capture_output=True, text=True).stdout

    frames = Frames(reader)
    frames.start()

    def shown(seen: str, absent: str, sent: float) -> None:
        while time.monotonic() - sent < SHOWN_WITHIN_S:
            pane = text()
            if seen in pane and absent not in pane:
                return
            frames.wait(0.2)
        raise SystemExit(f"{seen!r} not shown within {SHOWN_WITHIN_S} s")

    to_frame: list[float] = []  # the UI thread's CPU seconds from each key to its frame

    def press(key: str, seen: str, absent: str) -> float:
        """Send `key`; the wait until the bytes written since show `seen`'s title."""
        sent, since, ui_cpu = time.monotonic(), frames.mark(), cpu_seconds(pid, pid)
        subprocess.run([*tmux, "send-keys", "-t", "keys", key], check=True)
        at = frames.until(seen.encode(), since, sent + SHOWN_WITHIN_S)
        if at is None:
            raise SystemExit(f"{seen!r} not written within {SHOWN_WITHIN_S} s")
        to_frame.append(cpu_seconds(pid, pid) - ui_cpu - ui_idle_rate * (at - sent))
        shown(seen, absent, sent)  # the pane shows it, the old screen gone
        return at - sent

    waits = []
    try:
        shown("Chunk queue", "Live configuration", time.monotonic())
        time.sleep(SETTLE_S)
        pid = int(subprocess.run([*tmux, "display-message", "-p", "-t", "keys", "#{pane_pid}"],
                                 capture_output=True, text=True, check=True).stdout)
        idle_from, idle_cpu, idle_ui = time.monotonic(), cpu_seconds(pid), cpu_seconds(pid, pid)
        time.sleep(IDLE_S)
        start, start_cpu = time.monotonic(), cpu_seconds(pid)
        idle_rate = (start_cpu - idle_cpu) / (start - idle_from)
        ui_idle_rate = (cpu_seconds(pid, pid) - idle_ui) / (start - idle_from)
        for n in range(args.presses):
            key, seen, absent = (("2", "Live configuration", "Chunk queue") if n % 2 == 0
                                 else ("1", "Chunk queue", "Live configuration"))
            waits.append(press(key, seen, absent) * 1000)
        spent = cpu_seconds(pid) - start_cpu - idle_rate * (time.monotonic() - start)
    finally:
        for hog in hogs:
            hog.kill()
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        os.close(reader)
        shutil.rmtree(workdir, ignore_errors=True)
    waits.sort()
    print(json.dumps({"presses": len(waits), "hogs": args.hogs,
                      "median_ms": round(statistics.median(waits), 1),
                      "p90_ms": round(waits[int(0.9 * (len(waits) - 1))], 1),
                      "max_ms": round(waits[-1], 1),
                      "cpu_ms_per_press": round(1000 * spent / len(waits), 1),
                      "ui_cpu_ms_to_frame": round(1000 * statistics.mean(to_frame), 1),
                      "idle_cpu_pct": round(100 * idle_rate, 2),
                      "load_1m": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
