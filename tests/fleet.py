"""Two `tokenflow serve` processes writing into one PostgreSQL store under load, killed with
SIGKILL and restarted in turn: what the test and benchmarks/store_fleet_kill.py run.

Clients send completions to both servers for the whole run. Each cycle waits until the
victim has answered new requests since its last start (the kill lands under load), kills
it with SIGKILL and starts it again under the same name: it must take its name's lock back
and resume its own journal. At the end both stop gracefully and the journal is checked: no
entry left unfinished, and no request the client received re-run after a restart.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine

from engine.store.recovery import ORPHANED
from tests.postgres import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVE_FLAGS = ("--model", "synthetic:tiny", "--device", "cpu", "--dtype", "float32",
               # every request a slow query, so both servers store some
               "--slow-query-threshold", "0.001", "--slow-query-min-overrun-ms", "0")


@dataclass
class Member:
    """One server of the fleet: its name, port and process; answers counted per start."""

    name: str
    db: str
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[str] | None = None
    answered: threading.Condition = field(default_factory=threading.Condition)
    answers_since_start: int = 0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "console.cli.main", "serve", *SERVE_FLAGS, "--port",
                str(self.port), "--db", self.db, "--server-name", self.name]

    def start(self) -> None:
        process = subprocess.Popen(self.command(), cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None
        banner = process.stdout.readline()  # printed once it resumed and is about to accept
        assert "http://" in banner, banner + (process.stderr.read() if process.stderr else "")
        with self.answered:
            self.answers_since_start = 0
        self.process = process

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            _out, err = self.process.communicate(timeout=120)
            assert self.process.returncode == 0, err
            self.process = None

    def wait_for_answers(self, count: int, timeout: float = 120.0) -> None:
        with self.answered:
            assert self.answered.wait_for(lambda: self.answers_since_start >= count, timeout)

    def record_answer(self) -> None:
        with self.answered:
            self.answers_since_start += 1
            self.answered.notify_all()


@dataclass
class Report:
    kills: int
    answered: dict[tuple[str, str], str] = field(default_factory=dict)  # (server, id): state
    client_failures: int = 0  # refused or cut off by a kill: reported failed to the client
    states: Counter[str] = field(default_factory=Counter)  # the journal's, at the end
    unfinished: list[tuple[str, str]] = field(default_factory=list)
    rerun_after_answer: list[tuple[str, str]] = field(default_factory=list)
    resumed: int = 0  # journal entries a restart resumed
    refusal: str = ""  # what a second serve under a live server's name said

    def ok(self) -> bool:
        return not self.unfinished and not self.rerun_after_answer and bool(self.answered)


def send_until(done: threading.Event, members: list[Member], report: Report,
               lock: threading.Lock, local: random.Random) -> None:
    """One client: completions to a member drawn at random until `done`, each answer noted
    in `report` under the member that gave it, each failure counted."""
    with httpx.Client(timeout=60) as http:
        while not done.is_set():
            member = members[local.randrange(len(members))]
            body = {"model": "synthetic:tiny", "prompt": "fleet " * local.randrange(4, 40),
                    "max_tokens": local.randrange(2, 12)}
            try:
                response = http.post(f"http://127.0.0.1:{member.port}/v1/completions",
                                     json=body)
            except httpx.HTTPError:
                response = None
            if response is None or response.status_code != 200:
                with lock:
                    report.client_failures += 1
                continue
            request_id = response.json()["id"].removeprefix("cmpl-")
            with lock:
                report.answered[(member.name, request_id)] = "answered"
            member.record_answer()


def soak(db: str, *, kills: int, clients: int = 4, answers_before_kill: int = 3,
         seed: int = 0) -> Report:
    rng = random.Random(seed)
    members = [Member("box-a", db), Member("box-b", db)]
    report = Report(kills)
    lock, done = threading.Lock(), threading.Event()

    def client(index: int) -> None:
        send_until(done, members, report, lock, random.Random(seed * 100 + index))

    for member in members:
        member.start()
    twin = Member(members[0].name, db)  # the same name on a port of its own
    twin = subprocess.run(twin.command(), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # refused before its model loads
    assert twin.returncode == 2, twin.stderr
    report.refusal = twin.stderr.strip()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    try:
        for cycle in range(kills):
            victim = members[cycle % 2]
            victim.wait_for_answers(answers_before_kill + rng.randrange(3))
            victim.kill()
            victim.start()
        for member in members:
            member.wait_for_answers(1)
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=120)
        for member in members:
            if member.process is not None and member.process.poll() is None:
                member.stop()
    _check(db, report)
    return report


def _check(db: str, report: Report) -> None:
    engine = create_engine(db)
    try:
        with engine.connect() as connection:
            rows = connection.exec_driver_sql(
                "SELECT server, request_id, state, resume_attempts, finish_reason "
                "FROM request_journal").all()
    finally:
        engine.dispose()
    journal = {(server, rid): (state, attempts, reason)
               for server, rid, state, attempts, reason in rows}
    report.states = Counter(state for state, _, _ in journal.values())
    report.unfinished = sorted(key for key, (state, _, _) in journal.items()
                               if state not in ("FINISHED", "FAILED", "REJECTED", "QUARANTINED"))
    report.resumed = sum(1 for _, attempts, _ in journal.values() if attempts)
    for key in report.answered:
        state, attempts, reason = journal.get(key, ("missing", 0, None))
        if state == "FINISHED" and reason == ORPHANED:
            state = "aborted"  # closed by a newcomer as unanswered, though it was answered
        report.answered[key] = state
        if state != "FINISHED" or attempts:
            report.rerun_after_answer.append(key)


def listed_servers(db: str) -> set[str]:
    """The servers `tokenflow slow-queries list` shows, from one listing of the store."""
    listing = subprocess.run([sys.executable, "-m", "console.cli.main", "slow-queries", "list",
                              "--db", db, "--limit", "200", "--sort", "time"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    header, *rows = listing.splitlines()
    column = header.split().index("SERVER")
    return {re.split(r"\s{2,}", row)[column] for row in rows if row.strip()}
