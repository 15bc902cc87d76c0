"""SIGKILL `tokenflow db upgrade` of a big store at random moments of its migration; the next
start must open every store and bring it to head.

One store at revision 0003 with `--rows` slow queries (chunks and config as an engine writes
them) is built once and copied for each kill. Each cycle starts `tokenflow db upgrade` on a
fresh copy, kills it with SIGKILL at a random moment between the command's start-up and the end
of a whole upgrade,
then opens the store as every start does (`open_database`) and checks its revision and rows.

    PYTHONPATH=. .venv/bin/python benchmarks/store_migrate_kill.py [--rows 1000000] [--kills 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.store import head_revision, open_database
from engine.store.database import upgrade_database

CHUNKS = json.dumps([{"index": i, "start": i * 256, "tokens": 256, "duration_s": 0.031,
                      "predicted_s": 0.012} for i in range(4)])
CONFIG = json.dumps({"max_num_batched_tokens": 512, "chunk_tile": 16, "max_prefill_chunks": 4})


def build(path: Path, rows: int) -> None:
    database = open_database(path, upgrade=False)
    upgrade_database(database, "0003")
    database.close()
    with sqlite3.connect(path) as raw:
        step = 50_000
        for first in range(0, rows, step):
            raw.executemany(
                "INSERT INTO slow_queries (created_at, request_id, tenant, budget_score, "
                "prompt_tokens, prefill_s, budgeted_s, chunks, config) "
                "VALUES (?, ?, 't', ?, 1024, 0.12, 0.05, ?, ?)",
                ((1.7e9 + i, f"r{i}", 1.5 + (i % 97) / 10, CHUNKS, CONFIG)
                 for i in range(first, min(rows, first + step))))
        raw.commit()


def upgrade_command(path: Path) -> list[str]:
    return [sys.executable, "-m", "console.cli.main", "db", "upgrade", "--db", str(path)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "template.db"
        started = time.perf_counter()
        build(template, args.rows)
        print(f"built {args.rows} slow queries at 0003 in {time.perf_counter() - started:.1f} s "
              f"({template.stat().st_size / 2**20:.0f} MiB)", flush=True)
        whole = Path(tmp) / "whole.db"
        shutil.copy(template, whole)
        started = time.perf_counter()
        subprocess.run(upgrade_command(whole), env=env, check=True, capture_output=True)
        upgrade_s = time.perf_counter() - started
        started = time.perf_counter()  # the command's start-up alone, to kill past it
        subprocess.run([*upgrade_command(whole)[:-4], "db", "current", "--db", str(whole)],
                       env=env, check=True, capture_output=True)
        startup_s = time.perf_counter() - started
        print(f"an uninterrupted upgrade takes {upgrade_s:.1f} s, of which the command's "
              f"start-up {startup_s:.1f} s", flush=True)
        results = []
        for cycle in range(args.kills):
            store = Path(tmp) / "killed.db"
            for suffix in ("", "-wal", "-shm"):
                Path(f"{store}{suffix}").unlink(missing_ok=True)
            shutil.copy(template, store)
            at = rng.uniform(min(startup_s, upgrade_s * 0.9), upgrade_s)
            child = subprocess.Popen(upgrade_command(store), env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(at)
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            with sqlite3.connect(store) as raw:
                left_at = raw.execute("SELECT version_num FROM alembic_version").fetchone()
            started = time.perf_counter()
            database = open_database(store)  # what every start does
            try:
                revision = database.revision()
                count = database.engine.connect().exec_driver_sql(
                    "SELECT count(*) FROM slow_queries").scalar()
            finally:
                database.close()
            ok = revision == head_revision() and count == args.rows
            results.append(ok)
            print(json.dumps({"cycle": cycle, "killed_at_s": round(at, 2),
                              "left_at": left_at[0] if left_at else None,
                              "next_start_s": round(time.perf_counter() - started, 2),
                              "revision": revision, "rows": count, "ok": ok}), flush=True)
    print(f"{sum(results)}/{len(results)} stores opened and reached head "
          f"({head_revision()}) on the next start")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
