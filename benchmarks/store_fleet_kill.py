"""Two `tokenflow serve` processes (box-a, box-b) on one PostgreSQL store under load, with
20 SIGKILL-and-restart cycles between them (tests/fleet.py does the work; tests/test_fleet.py
runs it with 2 kills).

Reports: requests answered, requests reported failed to their clients (refused or cut off
by a kill), the journal's states at the end, entries a restart resumed, entries left
unfinished (must be 0), requests run again or missing from the journal after their client
had the answer (must be 0), what a second serve under a live name was told, and the servers
one `tokenflow slow-queries list` shows (must be both).

    PYTHONPATH=. .venv/bin/python benchmarks/store_fleet_kill.py [--db URL] [--kills 20]

Without --db it starts a throwaway cluster (tests/postgres.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tests.fleet import listed_servers, soak
from tests.postgres import cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="a PostgreSQL URL (default: a throwaway cluster)")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()

    def run(db: str) -> bool:
        started = time.perf_counter()
        report = soak(db, kills=args.kills, clients=args.clients)
        servers = listed_servers(db)
        print(json.dumps({
            "kills": report.kills, "wall_s": round(time.perf_counter() - started, 1),
            "answered": len(report.answered), "client_failures": report.client_failures,
            "journal_states": dict(report.states), "resumed_by_a_restart": report.resumed,
            "unfinished": report.unfinished,
            "rerun_or_missing_after_answer": {f"{s}/{r}": report.answered[(s, r)]
                                              for s, r in report.rerun_after_answer},
            "second_serve_same_name": report.refusal,
            "servers_in_one_listing": sorted(servers)}, indent=2))
        return report.ok() and {"box-a", "box-b"} <= servers

    if args.db:
        ok = run(args.db)
    else:
        with cluster() as started:
            ok = run(started.create_database())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
