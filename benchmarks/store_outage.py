"""Two `tokenflow serve` processes (box-a, box-b) on one PostgreSQL store under load, while
PostgreSQL is restarted --restarts times and a server's lock connection is killed --kills
times (each kill followed at once by a new process under the same name, as an operator's
restart would be).

Each restart: both servers must keep answering while PostgreSQL is down, say so on /health
("degraded", store "unreachable"), and carry on when it is back. Each kill: either the old
process takes its free name back and the newcomer is refused, or the newcomer takes it and the
old one stops writing, says so and exits 2; in both cases no request a client got an answer
for may be stored as anything but FINISHED. At the end: entries left unfinished (must be 0),
answered requests missing, re-run or misrecorded (must be 0), tracebacks (must be 0).

    PYTHONPATH=. .venv/bin/python benchmarks/store_outage.py [--restarts 10] [--kills 10]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
from sqlalchemy import Connection, create_engine, text

from engine.store import open_database
from engine.store.lock import StoreLockedError
from engine.store.recovery import abort_orphans
from engine.store.server_lock import _BARRIER, _NAMESPACE, lock_key
from tests.fleet import ROOT, Member, Report, _check, send_until
from tests.postgres import Cluster, cluster

DOWN_S = 3.0  # how long PostgreSQL stays down each restart


@dataclass
class Logged(Member):
    """A member whose stderr is read as it comes (a full pipe would stall the server)."""

    logs: list[str] = field(default_factory=list)

    def start(self) -> None:
        process = subprocess.Popen(self.command(), cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None and process.stderr is not None
        banner = process.stdout.readline()
        if "http://" not in banner:
            self.logs.append(process.stderr.read())
            raise RuntimeError(banner)
        threading.Thread(target=lambda err=process.stderr: self.logs.extend(err),
                         daemon=True).start()
        with self.answered:
            self.answers_since_start = 0
        self.process = process


def health(member: Member) -> dict[str, object]:
    try:
        return httpx.get(f"http://127.0.0.1:{member.port}/health", timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"status": f"{type(exc).__name__}"}


def lock_backend(db: str, member: Member) -> int:
    """The backend pid of `member`'s server-name lock session."""
    assert member.process is not None
    engine = create_engine(db)
    try:
        with engine.connect() as connection:
            return int(connection.execute(text(
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE :name"),
                {"name": f"pid {member.process.pid} %"}).scalar() or 0)
    finally:
        engine.dispose()


def take_over(db: str, name: str, killed_pid: int) -> int | None:
    """The worst race for the name, played on purpose: hold the write barrier (the old
    process's next batch waits on it), end its lock session, let a newcomer take the name and
    close the orphans as `serve` does, then let the old batch go. How many it closed; None if
    the old process kept the name."""
    barrier = create_engine(db)
    database = open_database(db, server=name, upgrade=False)
    keys = {"ns": _BARRIER, "key": lock_key(name)}
    closed: list[int | None] = [None]
    try:
        with barrier.connect() as hold:
            hold.execute(text("SELECT pg_advisory_lock(CAST(:ns AS int4), CAST(:key AS int4))"),
                         keys)
            terminate(hold, killed_pid)

            def newcomer() -> None:
                try:
                    database.claim_writer()  # waits at the barrier once it has the name
                    closed[0] = len(abort_orphans(database))
                except StoreLockedError:
                    closed[0] = None

            thread = threading.Thread(target=newcomer, daemon=True)
            thread.start()
            for _ in range(2000):  # until the newcomer holds the name (or gave up)
                held = hold.execute(text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                    "classid = CAST(:ns AS oid) AND objid = CAST(:key AS oid) AND objsubid = 2 "
                    "AND granted"), {"ns": _NAMESPACE, "key": lock_key(name)}).scalar()
                hold.commit()
                if held or not thread.is_alive():
                    break
                time.sleep(0.005)
            hold.execute(text("SELECT pg_advisory_unlock(CAST(:ns AS int4), "
                              "CAST(:key AS int4))"), keys)
            hold.commit()
            thread.join(60)
    finally:
        database.close()
        barrier.dispose()
    return closed[0]


def terminate(connection: Connection, pid: int) -> None:
    connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    for _ in range(2000):
        if not connection.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"),
                                  {"pid": pid}).scalar():
            return
        time.sleep(0.005)


def run(pg: Cluster, restarts: int, kills: int, clients: int) -> dict[str, object]:
    db = pg.create_database()
    members = [Logged("box-a", db), Logged("box-b", db)]
    report = Report(kills)
    lock, done = threading.Lock(), threading.Event()
    degraded_seen: list[bool] = []
    outcomes: list[str] = []
    old_logs: list[str] = []

    def client(index: int) -> None:
        send_until(done, members, report, lock, random.Random(index))

    for member in members:
        member.start()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    try:
        for _ in range(restarts):
            for member in members:
                member.wait_for_answers(2)
            pg.stop()
            time.sleep(DOWN_S / 2)
            degraded_seen.append(all(health(m).get("status") == "degraded" for m in members))
            time.sleep(DOWN_S / 2)
            pg.start()
            for member in members:
                member.wait_for_answers(2)
        for cycle in range(kills):
            victim = members[cycle % 2]
            victim.wait_for_answers(2)
            for _ in range(600):  # its writer holds the name again (it may still be retrying)
                if health(victim).get("status") == "ok":
                    break
                time.sleep(0.05)
            old = victim.process
            assert old is not None
            backend = lock_backend(db, victim)
            # a newcomer racing for the name: what `serve` does first (take it, close the
            # orphans), done from here, since a new process takes seconds to start
            closed = take_over(db, victim.name, backend)
            killed = int(backend > 0)
            if closed is None:  # the old process took its name back first
                outcomes.append(f"kill {killed}: old kept the name, newcomer refused")
                continue
            code = old.wait(timeout=60)  # it notices at its next write batch
            old_logs.extend(victim.logs)
            newcomer = Logged(victim.name, db)  # then a server runs under the name again
            newcomer.start()
            outcomes.append(f"kill {killed}: newcomer took the name and closed {closed} "
                            f"unanswered, old exited {code}")
            members[cycle % 2] = newcomer
            newcomer.wait_for_answers(2)
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=120)
        for member in members:
            if member.process is not None and member.process.poll() is None:
                member.stop()
    wall = time.perf_counter() - started
    _check(db, report)
    logs = "".join(line for m in members for line in m.logs) + "".join(old_logs)
    return {
        "restarts": restarts, "down_s_each": DOWN_S, "kills": kills,
        "wall_s": round(wall, 1), "answered": len(report.answered),
        "client_failures": report.client_failures,
        "health_degraded_during_every_outage": all(degraded_seen),
        "kill_outcomes": outcomes, "journal_states": dict(report.states),
        "unfinished": len(report.unfinished),
        "answered_but_not_finished_or_rerun": len(report.rerun_after_answer),
        "samples": [f"{server}/{rid}: {report.answered[(server, rid)]}"
                    for server, rid in report.rerun_after_answer[:5]],
        "tracebacks": logs.count("Traceback"),
        "lock_loss_said": sum("was lost" in line or "taken over" in line
                              for line in old_logs),
        # answers a writer had given from memory and recorded after its name was lost
        "recorded_after_name_lost": sum(
            int(found.group(1)) for line in old_logs
            if (found := re.search(r"recorded the outcomes of (\d+) requests", line))),
        "unrecorded_said": sum("could not be recorded" in line for line in old_logs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    with cluster() as pg:
        result = run(pg, args.restarts, args.kills, args.clients)
    print(json.dumps(result, indent=2))
    ok = (result["unfinished"] == 0 and result["answered_but_not_finished_or_rerun"] == 0
          and result["tracebacks"] == 0 and result["health_degraded_during_every_outage"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
