"""The console as an operator runs it through a long backlog: the embedded default engine in
a real terminal (a detached tmux session, 160x45), its traffic held at a backlog of
`--low`..`--high` waiting requests for `--minutes` by typing the arrival rate into the Tuning
form (`--rate` while under the band, `--hold-rate` above it), an operator pause (`p`, held
`--pause-s`), and a CPU hog (a busy loop, not niced) started and stopped twice. Then
`--light-minutes` of light traffic (the backlog drained, one request at a time), where the
bandwidth throttle must stay off.

Every `--sample-s` it samples the engine process's RSS (and its anonymous memory and glibc
heap from /proc/PID/smaps), the waiting and running counts and the header's states from the
pane. At the end it reads the store: slow queries by the cause their verdict leads with,
calibrations (and those measured under contention), drift events, and rate changes typed.

Prints one JSON object (samples, events, store tallies, RSS at 5 and 30 minutes and the
growth after the 5-minute mark, `--mark-s`). Exits 1 if the engine's RSS grew more than
`--tolerance` after that mark, a recalibration ran under contention, the throttle showed at
one running request, or the console did not quit cleanly.

    python benchmarks/console_backlog_run.py [--minutes 30] [--db /tmp/run.db]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
from console_soak import console_program, find_console, store_bytes

COUNTS = re.compile(r"(\d+) running · (\d+) waiting")
HOST = re.compile(r"host (busy|quiet)")  # the Bandwidth pane's host line
HEADER_STATES = ("BANDWIDTH_THROTTLE", "HOST BUSY", "PAUSED", "CACHE_PRESSURE_WAIT",
                 "BACKLOG", "CALIBRATION REUSED")
SHOWN_WITHIN_S = 20.0


class Console:
    """The console in its tmux pane: keys in, the screen out."""

    def __init__(self, tmux: list[str], target: str) -> None:
        self.tmux, self.target = tmux, target

    def keys(self, *names: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", self.target, *names], check=True)

    def text(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", self.target],
                              capture_output=True, text=True).stdout

    def wait_for(self, seen: str, within_s: float = SHOWN_WITHIN_S) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if seen in self.text():
                return True
            time.sleep(0.3)
        return False

    def set_rate(self, rate: float) -> bool:
        """Type `rate` into the Tuning form's first field and apply it, back on Live."""
        self.keys("2")
        if not self.wait_for("Live configuration"):
            self.keys("1")
            return False
        self.keys("Tab", *f"{rate:g}", "Enter")
        time.sleep(1.0)
        self.keys("1")
        return self.wait_for("Chunk queue")


def engine_process(console: psutil.Process) -> psutil.Process | None:
    """The console's spawned engine child (not the resource tracker)."""
    with contextlib.suppress(psutil.Error):
        for child in console.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "resource_tracker" not in " ".join(child.cmdline()):
                    return child
    return None


def memory(process: psutil.Process | None) -> dict[str, int]:
    """RSS, anonymous memory and the glibc main heap of `process`, in bytes (0 once gone)."""
    out = {"rss": 0, "anon": 0, "heap": 0}
    if process is None:
        return out
    with contextlib.suppress(psutil.Error, OSError):
        out["rss"] = process.memory_info().rss
        current = ""
        with open(f"/proc/{process.pid}/smaps") as smaps:
            for line in smaps:
                head = line.split()
                if not head:
                    continue
                if not head[0].endswith(":"):  # a mapping's header line
                    current = head[5] if len(head) > 5 else ""
                elif head[0] == "Anonymous:":
                    kib = int(head[1]) * 1024
                    out["anon"] += kib
                    if current == "[heap]":
                        out["heap"] += kib
    return out


def store_tallies(db: Path, hogs: list[tuple[float, float]]) -> dict[str, Any]:
    """What the store says about the run: verdicts by cause, calibrations, drift, rates."""
    from engine.store import open_database
    from engine.store.models import (
        CalibrationRunRow,
        ConfigChangeRow,
        DriftEventRow,
        SlowQueryRow,
    )

    database = open_database(db, read_only=True)
    try:
        with database.session() as session:
            rows = session.query(SlowQueryRow.felt_cause, SlowQueryRow.represents,
                                 SlowQueryRow.rules, SlowQueryRow.created_at).all()
            calibrations = session.query(CalibrationRunRow).order_by(CalibrationRunRow.id).all()
            drift = session.query(DriftEventRow).count()
            rates = session.query(ConfigChangeRow).filter(
                ConfigChangeRow.field == "arrival_rate").count()
            stored_calibrations = [{
                "id": c.id, "created_at": c.created_at, "reason": c.reason,
                "contended": bool(((c.info.get("provenance") or {}).get("load") or {})
                                  .get("contended")),
                "during_hog": any(a <= c.created_at <= b for a, b in hogs),
            } for c in calibrations]
    finally:
        database.close()
    by_cause = Counter(cause or "unknown" for cause, _, _, _ in rows)
    represented = Counter()
    for cause, represents, _, _ in rows:
        represented[cause or "unknown"] += represents
    during_hog = Counter(cause or "unknown" for cause, _, _, at in rows
                         if any(a <= at <= b for a, b in hogs))
    return {
        "slow_queries_stored": len(rows),
        "verdicts_by_cause": dict(by_cause),
        "breaches_by_cause": dict(represented),
        "verdicts_by_cause_during_hogs": dict(during_hog),
        "rules": dict(Counter(rules for _, _, rules, _ in rows)),
        "calibrations": stored_calibrations,
        "recalibrations_under_contention": sum(
            1 for c in stored_calibrations[1:] if c["contended"] or c["during_hog"]),
        "drift_events": drift,
        "rate_changes": rates,
    }


def at(samples: list[dict[str, Any]], t_s: float) -> dict[str, Any] | None:
    """The sample nearest `t_s`."""
    return min(samples, key=lambda s: abs(s["t_s"] - t_s)) if samples else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="the backlog's length")
    parser.add_argument("--light-minutes", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals/s under the band")
    parser.add_argument("--hold-rate", type=float, default=1.0, help="arrivals/s above it")
    parser.add_argument("--light-rate", type=float, default=0.1)
    parser.add_argument("--low", type=int, default=800)
    parser.add_argument("--high", type=int, default=1000)
    parser.add_argument("--pause-at-s", type=float, default=660.0)
    parser.add_argument("--pause-s", type=float, default=84.0)
    parser.add_argument("--hogs-at-s", type=float, nargs=2, default=(420.0, 1080.0))
    parser.add_argument("--hog-s", type=float, default=150.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--mark-s", type=float, default=300.0,
                        help="RSS is judged against its level here")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--nice", type=int, default=19, help="the console's niceness")
    parser.add_argument("--db", type=Path, help="the store (default: a new temporary one)")
    parser.add_argument("--console-args", default="", help="more console flags, as one string")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        parser.error("tmux is not installed: apt-get install tmux")
    if args.minutes * 60 <= args.mark_s:
        parser.error("--minutes must reach beyond --mark-s")
    db = args.db or Path(tempfile.mkdtemp(prefix="backlog-run-")) / "run.db"
    if db.exists():
        parser.error(f"{db} exists: name a new store, so the tallies are this run's alone")
    socket = f"tokenflow-backlog-{time.monotonic_ns()}"
    tmux = ["tmux", "-L", socket]
    # the console niced as every helper's work is here; the hog not, as another user's job
    command = (f"cd {Path(__file__).resolve().parents[1]} && nice -n {args.nice} "
               f"{console_program()} --db {db} "
               f"--rate {args.rate:g} {args.console_args}; echo console exited $?; sleep 600")
    subprocess.run([*tmux, "new-session", "-d", "-s", "run", "-x", "160", "-y", "45", command],
                   check=True)
    pane = Console(tmux, "run")
    samples: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    hogs: list[tuple[float, float]] = []  # wall-clock spans, as the store's times are
    hog: subprocess.Popen[bytes] | None = None
    quit_cleanly = False
    try:
        pane_pid = int(subprocess.run([*tmux, "display-message", "-p", "-t", "run",
                                       "#{pane_pid}"], capture_output=True, text=True,
                                      check=True).stdout)
        console = find_console(psutil.Process(pane_pid), 60.0)
        if not pane.wait_for("Chunk queue", 180.0):
            raise SystemExit(f"the live panes did not show within 180 s:\n{pane.text()}")
        start = time.monotonic()
        backlog_end = start + args.minutes * 60
        end = backlog_end + args.light_minutes * 60
        plan = sorted([(args.pause_at_s, "pause"), (args.pause_at_s + args.pause_s, "resume"),
                       *((t, "hog on") for t in args.hogs_at_s),
                       *((t + args.hog_s, "hog off") for t in args.hogs_at_s)])
        rate, light = args.rate, False
        next_sample = start

        def event(what: str, **more: Any) -> None:
            events.append({"t_s": round(time.monotonic() - start, 1), "what": what, **more})

        while (now := time.monotonic()) < end and console.is_running():
            t_s = now - start
            while plan and plan[0][0] <= t_s:
                _, what = plan.pop(0)
                if what in ("pause", "resume"):
                    pane.keys("p")
                elif what == "hog on":
                    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    hogs.append((time.time(), float("inf")))
                else:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                        hog = None
                    hogs[-1] = (hogs[-1][0], time.time())
                event(what)
            if now >= next_sample:
                text = pane.text()
                counts = COUNTS.search(text)
                header = text.splitlines()[0] if text else ""
                running, waiting = (int(counts[1]), int(counts[2])) if counts else (None, None)
                engine = engine_process(console)
                samples.append({"t_s": round(t_s, 1), "running": running, "waiting": waiting,
                                "states": [s for s in HEADER_STATES if s in header],
                                "host": (host := HOST.search(text)) and host[1],
                                "hog": hog is not None, "engine_pid": engine and engine.pid,
                                **memory(engine), "console_rss": memory(console)["rss"],
                                "store_bytes": store_bytes(db),
                                "load": round(psutil.getloadavg()[0], 2)})
                if "Traceback" in text or "console exited" in text:
                    event("console failed", screen=text)
                    break
                wanted = rate
                if now >= backlog_end:
                    if not light:
                        light, wanted = True, args.light_rate
                        event("light traffic")
                elif waiting is not None and waiting > args.high:
                    wanted = args.hold_rate
                elif waiting is not None and waiting < args.low:
                    wanted = args.rate
                if wanted != rate:
                    rate = wanted
                    event("rate", rate=rate, applied=pane.set_rate(rate))
                next_sample += args.sample_s
            time.sleep(max(0.0, min(next_sample, end) - time.monotonic()) if not plan
                       else max(0.0, min(next_sample, start + plan[0][0], end)
                                - time.monotonic()))
        if hog is not None:
            hog.kill()
            hog.wait()
            hogs[-1] = (hogs[-1][0], time.time())
            hog = None
        if console.is_running():
            pane.keys("q")
            with contextlib.suppress(psutil.TimeoutExpired):
                console.wait(120)
            quit_cleanly = "console exited 0" in pane.text()
    finally:
        if hog is not None:
            hog.kill()
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    tallies = store_tallies(db, hogs)
    backlog = [s for s in samples if s["t_s"] <= args.minutes * 60]
    mark, last = at(backlog, args.mark_s), at(backlog, args.minutes * 60)
    after = [s["rss"] for s in backlog if s["t_s"] >= args.mark_s and s["rss"]]
    growth = (max(after) - mark["rss"]) / mark["rss"] if mark and mark["rss"] and after else None
    anon_after = [s["anon"] for s in backlog if s["t_s"] >= args.mark_s and s["anon"]]
    anon_growth = ((max(anon_after) - mark["anon"]) / mark["anon"]
                   if mark and mark["anon"] and anon_after else None)
    lone_throttle = sum(1 for s in samples
                        if s["running"] == 1 and "BANDWIDTH_THROTTLE" in s["states"])
    ok = (growth is not None and growth <= args.tolerance and quit_cleanly
          and tallies["recalibrations_under_contention"] == 0 and lone_throttle == 0)
    print(json.dumps({
        "store": str(db), "args": {k: (str(v) if isinstance(v, Path) else v)
                                   for k, v in vars(args).items()},
        "events": events, "samples": samples, "store_tallies": tallies,
        "verdict": {
            "ok": ok, "quit_cleanly": quit_cleanly,
            "rss_at_mark": mark and mark["rss"], "rss_at_end_of_backlog": last and last["rss"],
            "rss_growth_after_mark": growth, "tolerance": args.tolerance,
            # file pages of shared libraries leave RSS when the machine is short of memory
            "anon_at_mark": mark and mark["anon"], "anon_at_end_of_backlog": last and last["anon"],
            "anon_growth_after_mark": anon_growth,
            "max_waiting": max((s["waiting"] or 0 for s in samples), default=0),
            "samples_with_waiting_ge_low": sum(1 for s in backlog
                                               if (s["waiting"] or 0) >= args.low),
            "throttle_samples": sum(1 for s in samples if "BANDWIDTH_THROTTLE" in s["states"]),
            "throttle_samples_at_one_running": lone_throttle,
            "host_busy_samples": sum(1 for s in samples if s["host"] == "busy"),
            "host_busy_samples_during_hogs": sum(1 for s in samples
                                                 if s["hog"] and s["host"] == "busy"),
            "hog_samples": sum(1 for s in samples if s["hog"]),
            "load_range": [min((s["load"] for s in samples), default=None),
                           max((s["load"] for s in samples), default=None)],
        },
    }, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
