"""A fleet's store in PostgreSQL: how fast list views are with 1,000,000 slow queries.

Fills a PostgreSQL store (migrated to head) with `--rows` slow queries from `--servers`
servers (COPY, chunks and timeline JSON as an engine writes them), ANALYZEs it, then times,
each the median of `--repeats` runs:
- `list_slow_queries` as `tokenflow slow-queries list --limit 50` runs it, in each order,
  filtered by server and by tenant, and the next page (keyset, --after);
- the console's first page of the Slow queries screen (500 newest, as its source reads);
- the whole `tokenflow slow-queries list --limit 50` command, process start-up included;
and prints PostgreSQL's plan of the default list, which must be an index walk.

    PYTHONPATH=. .venv/bin/python benchmarks/store_fleet.py [--db URL] [--rows 1000000]

Without --db it starts a throwaway cluster (tests/postgres.py: initdb, pg_ctl).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg

from engine.store import list_slow_queries, open_database
from tests.postgres import cluster

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = json.dumps([{"index": i, "start": i * 256, "tokens": 256, "duration_s": 0.031,
                      "predicted_s": 0.012} for i in range(8)])
CONFIG = json.dumps({"max_num_batched_tokens": 512, "chunk_tile": 16, "max_prefill_chunks": 4})
TIMELINE = json.dumps({"e2e_s": 1.2, "prefill_s": 0.4, "overrun_s": 0.2,
                       "e2e_parts": {"queue_wait": 0.1, "prefill": 0.4, "decode": 0.6,
                                     "tail": 0.1}})


@contextlib.contextmanager
def store(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    with cluster() as started:
        yield started.create_database()


def fill(url: str, rows: int, servers: int) -> None:
    open_database(url).close()  # the schema at head, with its indexes
    database = open_database(url, upgrade=False)
    conninfo = database.url.set(drivername="postgresql").render_as_string(hide_password=False)
    database.close()
    rng = random.Random(0)
    columns = ("server", "created_at", "request_id", "tenant", "tag", "budget_score",
               "prompt_tokens", "prefill_s", "budgeted_s", "chunks", "config", "timeline",
               "cause", "cause_share", "verdict")
    with psycopg.connect(conninfo) as connection, connection.cursor() as cursor, \
            cursor.copy(f"COPY slow_queries ({', '.join(columns)}) FROM STDIN") as copy:
        for i in range(rows):
            copy.write_row((f"gpu-box-{i % servers}:8000", 1.7e9 + i * 0.5, f"cmpl-{i}",
                            f"tenant-{i % 37}", None, 1.5 + rng.random() * 4,
                            rng.randrange(64, 8192), 0.1 + rng.random(), 0.05, CHUNKS, CONFIG,
                            TIMELINE, "queue", 0.7, "queued behind a long prefill"))
    with psycopg.connect(conninfo, autocommit=True) as connection:
        connection.execute("ANALYZE slow_queries")


def timed(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="a PostgreSQL URL (default: a throwaway cluster)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with store(args.db) as url:
        started = time.perf_counter()
        fill(url, args.rows, args.servers)
        print(f"stored {args.rows} slow queries from {args.servers} servers in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
        database = open_database(url, read_only=True)
        figures: dict[str, float] = {}
        with database.session() as session:
            first = list_slow_queries(session, limit=50)
            cases: dict[str, Callable[[], object]] = {
                f"list --sort {sort} --limit 50": (
                    lambda sort=sort: list_slow_queries(session, sort=sort, limit=50))
                for sort in ("score", "time", "prompt", "prefill", "id")}
            cases["list --server gpu-box-3:8000 --limit 50"] = lambda: list_slow_queries(
                session, server="gpu-box-3:8000", limit=50)
            cases["list --tenant tenant-5 --limit 50"] = lambda: list_slow_queries(
                session, tenant="tenant-5", limit=50)
            cases["list --limit 50 --after (next page)"] = lambda: list_slow_queries(
                session, limit=50, after=first[-1].id)
            cases["console first page (500 newest)"] = lambda: list_slow_queries(
                session, sort="time", limit=500)
            for name, work in cases.items():
                figures[name] = timed(work, args.repeats)
                print(f"{name:45s} {figures[name]:8.1f} ms", flush=True)
            plan = session.connection().exec_driver_sql(
                "EXPLAIN SELECT * FROM slow_queries ORDER BY budget_score DESC, id DESC "
                "LIMIT 50").scalars().all()
            print("plan of the default list:", " / ".join(line.strip() for line in plan[:3]))
        database.close()
        command = [sys.executable, "-m", "console.cli.main", "slow-queries", "list", "--db",
                   url, "--limit", "50"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        whole = timed(lambda: subprocess.run(command, env=env, check=True,
                                             capture_output=True), 3)
        print(f"{'tokenflow slow-queries list --limit 50':45s} {whole:8.1f} ms "
              "(whole process, start-up included)")


if __name__ == "__main__":
    main()
