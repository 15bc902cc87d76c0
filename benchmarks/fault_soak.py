"""Injected faults under load: exceptions raised from the runner and the scheduler at random
steps (alternately), `--faults` times, while `--clients` clients keep sending completions
(half of them streaming) to a served engine with a store. After each fault a probe request
must be answered within `--recover-s`; at the end nothing accepted may be lost or answered
twice (the journal holds every request once, finished) and
`tokenflow_engine_restarts_total` must equal the faults. Prints one JSON object; exits 1 on
any miss.

The engine is the GPU twin (simulated executor, no math) paced `--speed` times faster than
the wall clock, so faults half a simulated minute apart (never a crash loop: the supervisor
reads the engine's clock) come every few real seconds:

    python benchmarks/fault_soak.py [--faults 20] [--clients 8] [--speed 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import select

from engine.config import EngineConfig
from engine.harness.faults import StepFaults
from engine.serve.app import create_app
from engine.serve.session import EngineSession
from engine.serve.thread import ServerThread
from engine.sim.executor import Simulation
from engine.store.models import JournalRow

SPACING_S = 31.0  # simulated seconds between faults: at most two in the supervisor's minute


class FaultClock:
    """Contains a call number once the engine clock has passed the next fault's time, for the
    wrapped call whose turn it is (runner and scheduler alternate)."""

    def __init__(self, clock: object, faults: int, rng: random.Random) -> None:
        self.clock = clock
        self.turn = "runner"
        self.left = faults
        self.rng = rng
        self.due = clock() + SPACING_S  # type: ignore[operator]
        self.raised_at: list[float] = []  # wall time of each fault
        self.lock = threading.Lock()

    def calls(self, where: str) -> Turn:
        return Turn(self, where)

    def take(self, where: str) -> bool:
        with self.lock:
            if (where != self.turn or self.left <= 0
                    or self.clock() < self.due):  # type: ignore[operator]
                return False
            self.turn = "scheduler" if where == "runner" else "runner"
            self.left -= 1
            self.due = self.clock() + SPACING_S + self.rng.uniform(0, 5)  # type: ignore[operator]
            self.raised_at.append(time.perf_counter())
            return True


class Turn:
    def __init__(self, schedule: FaultClock, where: str) -> None:
        self.schedule = schedule
        self.where = where

    def __contains__(self, _call: object) -> bool:
        return self.schedule.take(self.where)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--speed", type=float, default=10.0)
    parser.add_argument("--recover-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    names = itertools.count()  # each request's prompt ends in its own name
    config = EngineConfig(model="synthetic:tiny", kv_cache_bytes=64 << 20)
    with tempfile.TemporaryDirectory() as folder:
        session = EngineSession.start(config, db=Path(folder) / "faults.db", calibrate=False,
                                      simulate=Simulation("a100", speed=args.speed))
        engine = session.engine
        engine.scheduler.controller.calibrated = True
        # one schedule, shared by both wrapped calls: faults alternate runner and scheduler
        schedule = FaultClock(engine.clock, args.faults, rng)
        runner = StepFaults(engine, schedule.calls("runner"), "runner")
        scheduler = StepFaults(engine, schedule.calls("scheduler"), "scheduler")
        loop = session.attach_loop().start()
        replies: list[tuple[str, int, int]] = []  # (id, status, completion tokens)
        stop = threading.Event()
        try:
            with ServerThread(create_app(loop, admin_token=None)) as server:
                def client(n: int) -> None:
                    with httpx.Client(base_url=server.url, timeout=60) as http:
                        while not stop.is_set():
                            replies.append(send(http, next(names), n % 2 == 1))

                threads = [threading.Thread(target=client, args=(n,), daemon=True)
                           for n in range(args.clients)]
                for thread in threads:
                    thread.start()
                recoveries = probe(server.url, schedule, args.faults, replies, names)
                stop.set()
                for thread in threads:
                    thread.join(120)
                with httpx.Client(base_url=server.url, timeout=30) as http:
                    restarts = metric(http.get("/metrics").text, "engine_restarts_total")
        finally:
            session.close()
        database_rows = journal(Path(folder) / "faults.db")
    ids = [rid for rid, _, _ in replies]
    failed = [r for r in replies if r[1] != 200]
    report = {
        "faults": len(schedule.raised_at), "runner_faults": runner.raised,
        "scheduler_faults": scheduler.raised, "engine_restarts_total": restarts,
        "requests": len(replies), "non_200": len(failed),
        "recovery_s_max": max(recoveries, default=None), "recoveries_s": recoveries,
        "journal_rows": len(database_rows),
        "journal_not_finished": sorted(r for r, s in database_rows.items() if s != "FINISHED"),
        "answered_twice": len(ids) - len(set(ids)),
        "missing_from_journal": sorted(set(ids) - set(database_rows)),
    }
    report["ok"] = (report["faults"] == args.faults == restarts and not failed
                    and max(recoveries, default=0) <= args.recover_s
                    and not report["journal_not_finished"] and not report["answered_twice"]
                    and not report["missing_from_journal"])
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


def send(http: httpx.Client, name: int, stream: bool) -> tuple[str, int, int]:
    """(the request's prompt as the journal stores it, HTTP status, tokens received): the
    prompt, ending in the request's own name, is what the journal knows it by."""
    prompt = [7] * (1 + name % 150) + [1 + (name // 250**i) % 250 for i in range(3)]
    rid = ",".join(map(str, prompt))
    body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, "stream": stream}
    if not stream:
        reply = http.post("/v1/completions", json=body)
        return rid, reply.status_code, reply.json().get("usage", {}).get("completion_tokens", 0)
    tokens = 0
    with http.stream("POST", "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return rid, 500, tokens
                tokens += sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
        return rid, reply.status_code, tokens


def probe(url: str, schedule: FaultClock, faults: int, replies: list[tuple[str, int, int]],
          names: itertools.count[int]) -> list[float]:
    """After each fault, seconds until a fresh request is answered in full."""
    recoveries: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        while len(recoveries) < faults:
            if len(schedule.raised_at) <= len(recoveries):
                time.sleep(0.05)  # a benchmark's poll for the next fault, not a test's wait
                continue
            fault = schedule.raised_at[len(recoveries)]
            while True:
                replies.append(send(http, next(names), False))
                if replies[-1][1] == 200:
                    break
            recoveries.append(round(time.perf_counter() - fault, 3))
    return recoveries


def metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(f"tokenflow_{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def journal(db: Path) -> dict[str, str]:
    from engine.store import open_database

    database = open_database(db)
    try:
        with database.session() as session:
            return {",".join(map(str, r.prompt_token_ids)): r.state
                    for r in session.scalars(select(JournalRow))}
    finally:
        database.close()


if __name__ == "__main__":
    sys.exit(main())
