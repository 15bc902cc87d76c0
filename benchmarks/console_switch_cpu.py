"""The console's CPU for one screen switch, without the noise of a shared machine: the console
(headless, Textual's own test driver) on the embedded engine in its child process
(synthetic:tiny, its default traffic), its polls stopped once the screens have shown live
figures, so each switch redraws what changed since the screen was last shown and nothing
else. The keys 2 (Tuning) and 1 (Live) are pressed in turn `--presses` times; each switch's
CPU is the UI thread's CPU time from the key until the screen has drawn and gone idle
(Textual's pilot waits for that). A thread's CPU time is what a load changes least: it is
the figure to compare across checkouts; console_keys.py gives the waits in a terminal.

Prints one JSON object: the median and max ms per switch to Tuning and to Live.

    python benchmarks/console_switch_cpu.py [--presses 20] [--root CHECKOUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = "2121"  # each screen composed and shown with figures before any is timed


async def measure(presses: int) -> dict[str, float]:
    from console.sources.process import ProcessSource
    from console.tui.app import TokenflowApp
    from engine.config import EngineConfig

    with tempfile.TemporaryDirectory(prefix="switch-cpu-") as workdir:
        source = ProcessSource.start(model="synthetic:tiny", device="cpu", workload="chat",
                                     rate=None, db=Path(workdir) / "switch.db", server=None,
                                     simulate=None, config=EngineConfig())
        app = TokenflowApp(source)
        spent: dict[str, list[float]] = {"2": [], "1": []}
        async with app.run_test(size=(120, 40)) as pilot:
            while app.state.latest is None:
                await pilot.pause(0.2)
            for key in WARM_UP:
                await pilot.press(key)
                await pilot.pause(1.0)  # a poll or two on each screen
            app.collector.stop()
            await pilot.pause(1.0)
            for n in range(presses):
                key = "2" if n % 2 == 0 else "1"
                before = time.thread_time()
                await pilot.press(key)
                await pilot.pause()
                spent[key].append((time.thread_time() - before) * 1000)
        source.close()
    return {f"{name}_median_ms": round(statistics.median(spent[key]), 1)
            for key, name in (("2", "tuning"), ("1", "live"))} | {
        f"{name}_max_ms": round(max(spent[key]), 1) for key, name in (("2", "tuning"),
                                                                        ("1", "live"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presses", type=int, default=20)
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--in-root", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.in_root:  # the checkout's own console: run again inside it
        env = {**os.environ, "PYTHONPATH": str(args.root.resolve())}
        return subprocess.run([sys.executable, __file__, "--presses", str(args.presses),
                               "--root", str(args.root), "--in-root"], cwd=args.root,
                              env=env, check=False).returncode
    figures = asyncio.run(measure(args.presses))
    print(json.dumps({"presses": args.presses, **figures,
                      "load_1m": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
