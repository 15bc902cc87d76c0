"""`tokenflow run`: drive a workload to the end headless and print a summary."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from console.cli.db import add_db_argument
from console.cli.engine_flags import add_engine_flags, engine_config
from console.cli.workload_flags import add_workload_flags, workload_for
from console.errors import UserError
from engine.core.engine import RequestOutput
from engine.harness.driver import drive
from engine.harness.workload import WorkloadRequest, describe, load_requests_jsonl
from engine.serve.session import EngineSession


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="drive a workload to the end headless",
                                   description=__doc__)
    add_engine_flags(parser)
    add_workload_flags(parser)
    parser.add_argument("--requests", type=Path, help="JSONL requests (id, prompt_token_ids or "
                        "prompt, max_tokens, optional tenant) instead of --workload")
    parser.add_argument("--output", type=Path, help="write finished requests here as JSONL "
                        "(id, token_ids; or id, error with the state and reason of a request "
                        "rejected or failed)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--resume", action="store_true",
                        help="first finish what a killed run left unfinished in the journal "
                             "(prompt + generated tokens are recomputed, generation goes on); "
                             "requests already in --output are not run again")
    add_db_argument(parser)
    parser.add_argument("--no-db", action="store_true",
                        help="keep no request journal (a crash then loses in-flight work)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.resume and args.no_db:
        raise UserError("--resume reads the request journal; drop --no-db")
    if args.requests and not args.requests.exists():
        raise UserError(f"--requests {args.requests}: no such file")
    with EngineSession.start(engine_config(args), db=args.db, store=not args.no_db) as session:
        engine = session.engine
        if args.requests:
            workload = load_requests_jsonl(args.requests, engine.tokenizer.encode)
        else:
            workload = workload_for(args, engine)
        sink = _OutputSink(args.output)
        try:
            remaining = workload
            if args.resume:
                remaining = _resume(session, workload, sink.emitted())
            result = drive(engine, remaining, on_output=sink.write)
        finally:
            sink.close()
    summary: dict[str, Any] = {"model": engine.config.model, "device": str(engine.runner.device),
                               "workload": describe(workload).to_dict(), **result.summary()}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


def _resume(session: EngineSession, workload: list[WorkloadRequest],
            emitted: set[str]) -> list[WorkloadRequest]:
    """Resume the journal's unfinished requests; return the part of `workload` that neither
    finished before nor is being resumed."""
    resumed = session.resume_unfinished(skip=emitted)
    assert session.database is not None  # --resume with --no-db is refused up front
    print(f"resumed {len(resumed)} unfinished request(s) from {session.database.path}",
          file=sys.stderr)
    skip = emitted | set(resumed)
    return [w for w in workload if w.request_id not in skip]


class _OutputSink:
    """Appends one JSON line per ended request, flushed at once so a crash loses none."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._file = path.open("a") if path else None

    def emitted(self) -> set[str]:
        """Ids already written (by an earlier, killed run), so none is emitted twice."""
        if self._path is None or not self._path.exists():
            return set()
        ids = set()
        for line in self._path.read_text().splitlines():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by the kill: that request is resumed instead
        return ids

    def write(self, output: RequestOutput) -> None:
        if not output.finished:
            return
        if output.state == "FINISHED":
            line = {"id": output.request_id, "token_ids": list(output.token_ids)}
        else:  # REJECTED or FAILED: said, with the reason, rather than silently missing
            print(f"request {output.request_id} {output.state}: {output.finish_reason}",
                  file=sys.stderr)
            line = {"id": output.request_id,
                    "error": {"state": output.state, "reason": output.finish_reason}}
        if self._file is not None:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _print_summary(s: dict[str, Any]) -> None:
    def fmt(p: dict[str, float | None]) -> str:
        return " ".join(f"{k}={v:.1f}" if v is not None else f"{k}=-" for k, v in p.items())

    print(f"{s['model']} on {s['device']}: {s['finished']}/{s['requests']} finished "
          f"in {s['wall_s']:.1f} s")
    print(f"  throughput {s['throughput_tok_s']:.1f} tok/s, output {s['output_tok_s']:.1f} tok/s")
    print(f"  TTFT ms {fmt(s['ttft_ms'])}")
    print(f"  TPOT ms {fmt(s['tpot_ms'])}")
    print(f"  step ms {fmt(s['step_ms'])}, preemptions {s['preemptions']}, "
          f"slow queries {s['slow_queries']}")
