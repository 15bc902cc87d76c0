"""The process the chaos suite's sigkill scenario kills and resumes (see docs/operations.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.batch import RequestOutput
from engine.config import EngineConfig
from engine.harness.driver import OutputTokens, drive
from engine.harness.workload import load_requests_jsonl
from engine.ops.equipped import Engine
from engine.store import StoreWriter, open_database
from engine.store.recovery import resume_unfinished
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
                output.write("\n")
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
                writer.flush()
                print(json.dumps({"held": {"step": steps, "emitted": written}}), flush=True)
                sys.stdin.readline()  # '' once the supervisor is gone: nothing to wait for

            drive(engine, [w for w in workload if w.request_id not in skip], on_output=write,
                  on_step=hold if args.hold else None)
    finally:
        writer.close()
        database.close()
    return 0


def _emitted(path: Path) -> set[str]:
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
