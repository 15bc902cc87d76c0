"""The process the chaos suite's sigkill scenario kills and then resumes: an engine that
journals to a store, serves the requests of a JSONL file and appends each one that ends to an
output file; with `--resume` it first finishes what the journal left unfinished.

It is the engine's own entry point, so the harness never launches the console's CLI:

    python -m engine.harness.chaos_child --requests R.jsonl --output O.jsonl --db J.db [--resume]
        [--report-commits [--hold]]

With `--report-commits` it prints a JSON line on stdout after each journal commit. With
`--hold` as well, each step is journaled before the next: after a step the child commits it,
prints `{"held": {"step": N, "emitted": K}}` (K requests written to the output so far) and
waits for a line on stdin before stepping on. The harness kills it at a held step, so where
the kill lands is decided by the journal's state, never by how fast the machine is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.batch import RequestOutput
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.harness.driver import OutputTokens, drive
from engine.harness.recovery import resume_unfinished
from engine.harness.workload import load_requests_jsonl
from engine.store import StoreWriter, open_database
from engine.store.writer import report_commit

# One tile a step: prompts of 40-160 tokens take several steps each, so a kill lands mid-chunk.
CONFIG = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                      max_num_batched_tokens=8, chunk_tile=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.harness.chaos_child",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--report-commits", action="store_true")
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args(argv)
    if args.hold and not args.report_commits:
        parser.error("--hold needs --report-commits: the supervisor decides on the commits")
    engine = Engine(CONFIG)
    workload = load_requests_jsonl(args.requests, engine.tokenizer.encode,
                                   vocab_size=engine.model_config.vocab_size)
    emitted = _emitted(args.output)
    database = open_database(args.db)
    writer = StoreWriter(database, engine.bus,
                         on_commit=report_commit if args.report_commits else None)
    try:
        with args.output.open("a") as output:
            if args.output.stat().st_size and not args.output.read_bytes().endswith(b"\n"):
                output.write("\n")  # the kill tore the last line: it stays a line of its own
            skip = set(emitted)
            tokens = OutputTokens()
            if args.resume:
                resumption = resume_unfinished(engine, database, skip=emitted)
                skip |= {*resumption.resumed, *resumption.quarantined}
                tokens = OutputTokens(resumption.generated)

            written = 0
            steps = 0

            def write(out: RequestOutput) -> None:
                nonlocal written
                held = tokens.add(out)
                if out.finished:
                    output.write(json.dumps({"id": out.request_id, "state": out.state,
                                             "token_ids": held}) + "\n")
                    output.flush()  # a kill loses no line already written
                    written += 1

            def hold() -> None:
                nonlocal steps
                steps += 1
                writer.flush()  # this step's commits are reported before the held line
                print(json.dumps({"held": {"step": steps, "emitted": written}}), flush=True)
                sys.stdin.readline()  # '' once the supervisor is gone: nothing to wait for

            drive(engine, [w for w in workload if w.request_id not in skip], on_output=write,
                  on_step=hold if args.hold else None)
    finally:
        writer.close()
        database.close()
    return 0


def _emitted(path: Path) -> set[str]:
    """Ids an earlier, killed run already wrote; a line the kill cut short is not one."""
    if not path.exists():
        return set()
    ids = set()
    for line in path.read_text().splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return ids


if __name__ == "__main__":
    sys.exit(main())
