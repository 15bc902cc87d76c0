"""Input latency of the console in a real terminal beside busy loops: the embedded console
(synthetic:tiny, its default traffic) in a detached tmux pane at 120x40, with `--hogs` busy
loops running; the screen keys 2 and 1 are pressed in turn `--presses` times, and each time
the wait from the key's send to the first frame that shows the new screen is taken. Frames
are read when the console writes to its pane (tmux pipe-pane into a FIFO), so the figure is
the key's round trip through tmux, the console and its redraw.

Prints one JSON object: median, p90 and max in ms, and the load average.

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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOWN_WITHIN_S = 180.0  # a hang guard


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

    def wait(seen: str, absent: str) -> float:
        sent = time.monotonic()
        while time.monotonic() - sent < SHOWN_WITHIN_S:
            shown = text()
            if seen in shown and absent not in shown:
                return time.monotonic() - sent
            select.select([reader], [], [], 1.0)
            with_data = True
            while with_data:
                try:
                    with_data = bool(os.read(reader, 1 << 16))
                except BlockingIOError:
                    with_data = False
        raise SystemExit(f"{seen!r} not shown within {SHOWN_WITHIN_S} s")

    waits = []
    try:
        wait("Chunk queue", "Live configuration")
        time.sleep(5.0)  # past the start-up's first redraws
        for n in range(args.presses):
            key, seen, absent = (("2", "Live configuration", "Chunk queue") if n % 2 == 0
                                 else ("1", "Chunk queue", "Live configuration"))
            subprocess.run([*tmux, "send-keys", "-t", "keys", key], check=True)
            waits.append(wait(seen, absent) * 1000)
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
                      "max_ms": round(waits[-1], 1), "load_1m": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
