"""Streams and the journal under `kill -9`: `--kills` times, start `tokenflow serve` on one
store, keep `--clients` streaming clients busy, and SIGKILL the server at a random moment.
After each kill the journal must hold a row for every request a client saw a token of, and
every request whose client read `[DONE]` must be final (never run again); each next start
closes what the killed server had in flight as aborted, so no request is ever resumed
(resume_attempts stays 0). Prints one JSON object; exits 1 on any miss.

    python benchmarks/stream_kills.py [--kills 20] [--clients 20]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Seen:
    first: set[str] = field(default_factory=set)  # a token reached the client
    done: set[str] = field(default_factory=set)  # [DONE] reached the client
    lock: threading.Lock = field(default_factory=threading.Lock)


def stream(url: str, rng: random.Random, seen: Seen, stop: threading.Event,
           names: itertools.count[int]) -> None:
    """Stream request after request; each is known by its prompt, which ends in a unique
    name (the reply's id names the completion, not the engine's request)."""
    with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            name = next(names)
            prompt = [7] * rng.randrange(4, 200) + [1 + (name // 250**i) % 250 for i in range(3)]
            body = {"prompt": prompt, "max_tokens": rng.randrange(4, 120), "ignore_eos": True,
                    "stream": True}
            rid, started = ",".join(map(str, prompt)), False
            with http.stream("POST", "/v1/completions", json=body) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {") and not started:
                        started = True
                        with seen.lock:
                            seen.first.add(rid)
                    elif line == "data: [DONE]" and started:
                        with seen.lock:
                            seen.done.add(rid)


def journal(db: Path) -> dict[str, tuple[str, str | None, int]]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
        rows = connection.execute("SELECT prompt_token_ids, state, finish_reason, "
                                  "resume_attempts FROM request_journal").fetchall()
    return {rid: (state, reason, attempts) for rid, state, reason, attempts in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    names = itertools.count()
    missing, not_final, accepted, completed = [], [], 0, 0
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "kills.db"
        for _kill in range(args.kills):
            server = subprocess.Popen(
                [sys.executable, "-m", "console.cli.main", "serve", "--model", "synthetic:tiny",
                 "--device", "cpu", "--dtype", "float32", "--port", "0", "--db", str(db)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert server.stdout is not None
            url = re.search(r"http://[^,\s]+", server.stdout.readline())
            assert url, "serve did not start"
            seen, stop = Seen(), threading.Event()
            clients = [threading.Thread(target=stream, daemon=True,
                                        args=(url.group(0), random.Random(rng.random()), seen,
                                              stop, names)) for _ in range(args.clients)]
            for client in clients:
                client.start()
            time.sleep(rng.uniform(1.0, 6.0))  # a random moment of the streams
            server.kill()
            server.wait(60)
            stop.set()
            for client in clients:
                client.join(60)
            rows = journal(db)
            with seen.lock:
                missing += sorted(seen.first - rows.keys())
                not_final += sorted(r for r in seen.done if rows.get(r, ("",))[0] != "FINISHED"
                                    or rows[r][1] not in ("length", "stop"))
                accepted += len(seen.first)
                completed += len(seen.done)
        # the start after the last kill closes its orphans too
        from engine.store import open_database
        from engine.store.recovery import abort_orphans

        database = open_database(db)
        try:
            abort_orphans(database)
        finally:
            database.close()
        rows = journal(db)
    report = {
        "kills": args.kills, "clients": args.clients, "requests_journaled": len(rows),
        "tokens_seen_requests": accepted, "done_seen_requests": completed,
        "seen_but_not_journaled": missing, "done_but_not_final": not_final,
        "resumed": sorted(r for r, row in rows.items() if row[2] > 0),
        "unfinished_at_end": sorted(r for r, row in rows.items()
                                    if row[0] not in ("FINISHED", "FAILED", "REJECTED")),
        "aborted_when_killed": sum(1 for row in rows.values()
                                   if (row[1] or "").startswith("aborted: the server")),
    }
    report["ok"] = not (missing or not_final or report["resumed"] or report["unfinished_at_end"])
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
