"""`tokenflow run`: drive a workload to the end headless and print a summary.

Its steps take up to 4096 tokens unless --max-num-batched-tokens says otherwise: an offline
batch, like vLLM's `LLM.generate`, which takes 4096 on CPU where its server takes 2048.
`tokenflow serve` and the console keep the engine's 256, sized for token latency."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from console.cli.db import (
    add_db_argument,
    add_server_name_argument,
    refuse_store_files,
    refuse_store_flags_without_a_store,
)
from console.cli.engine_flags import WATCHED_FLAGS, add_engine_flags, engine_config, start_session
from console.cli.output_file import check_output, open_output
from console.cli.process_age import process_age_s
from console.cli.progress import RunProgress, add_quiet_flag
from console.cli.terminal import terminal_safe
from console.cli.workload_flags import (
    add_workload_flags,
    check_requests_file_flags,
    requests_file_workload,
    workload_for,
)
from console.errors import UserError
from engine.core.engine_core import RequestOutput
from engine.harness.driver import OutputTokens, drive
from engine.harness.workload import (
    WorkloadRequest,
    describe,
    request_lines,
)
from engine.serve.session import EngineSession
from engine.store import StoreWriter
from engine.store.writer import report_commit

# No one watches a token's latency in a batch run: fewer, larger steps read the weights fewer
# times (docs/benchmarks.md has the figures).
RUN_BUDGET = 4096


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="drive a workload to the end headless",
                                   description=__doc__)
    add_engine_flags(parser, skip=WATCHED_FLAGS)
    parser.set_defaults(max_num_batched_tokens=RUN_BUDGET)
    add_workload_flags(parser)
    parser.add_argument("--requests", type=Path, help="JSONL requests (id, prompt_token_ids or "
                        "prompt, max_tokens, optional tenant and arrival_s) instead of "
                        "--workload; --rate paces a file without arrival_s")
    parser.add_argument("--output", type=Path, help="write finished requests here as JSONL "
                        "(id, token_ids; or id, error with the state and reason of a request "
                        "rejected or failed); a new file, or with --resume the one a killed "
                        "run left, never a symlink")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_quiet_flag(parser)
    parser.add_argument("--resume", action="store_true",
                        help="first finish what a killed run left unfinished in the journal "
                             "(prompt + generated tokens are recomputed, generation goes on); "
                             "requests already in --output are not run again")
    add_db_argument(parser)
    add_server_name_argument(parser, "this host")
    parser.add_argument("--no-db", action="store_true",
                        help="keep no request journal (a crash then loses in-flight work)")
    parser.add_argument("--report-commits", action="store_true",
                        help="print a JSON line on stdout each time the journal commits "
                             "(events, requests mid-prefill): what a supervisor such as "
                             "`tokenflow chaos` acts on")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.resume and args.no_db:
        raise UserError("--resume reads the request journal; drop --no-db")
    refuse_store_flags_without_a_store(args)
    if args.requests and not args.requests.exists():
        raise UserError(f"--requests {args.requests}: no such file")
    # A file's JSON is read before the model loads, so a bad line fails fast; a pipe can be
    # read only once, when the engine is ready for it.
    lines = request_lines(args.requests) if args.requests and args.requests.is_file() else None
    if args.requests:
        check_requests_file_flags(args, lines)
    if args.output is not None:  # before anything is written, the store included
        if not args.no_db:
            refuse_store_files(args.output, args.db)
        check_output(args.output, may_exist=args.resume,
                     keep_hint="pass --resume to finish the run that wrote it")
    started = time.monotonic() - (process_age_s() or 0.0)
    entered = time.monotonic()
    config = engine_config(args)
    progress = RunProgress("tokenflow run", 0, quiet=args.quiet)
    progress.stage(f"loading {config.model}")
    with start_session(config, db=args.db, store=not args.no_db, server=args.server_name,
                       resume=args.resume,
                       on_commit=report_commit if args.report_commits else None,
                       observers=(progress.on_calibration,)) as session:
        ready = time.monotonic()
        engine = session.engine
        progress.stage(engine.runner.attention_note)  # the backends chosen, with timings
        if args.requests:
            workload = requests_file_workload(
                args, request_lines(args.requests) if lines is None else lines,
                engine.tokenizer.encode, engine.model_config.vocab_size)
        else:
            workload = workload_for(args, engine)
        sink = _OutputSink(args.output, session.writer, resume=args.resume)
        first_token: list[float] = []

        def on_output(output: RequestOutput) -> None:
            if not first_token and output.new_token_ids:
                first_token.append(time.monotonic())
            sink.write(output)
            progress.on_output(output)

        try:
            remaining = workload
            if args.resume:
                remaining = _resume(session, workload, sink)
            progress.start(len(remaining))
            result = drive(engine, remaining, on_output=on_output)
        finally:
            progress.close()
            sink.close()
    if session.writer is not None:
        session.writer.check()  # the journal stopped at the end: the run must not look complete
    summary: dict[str, Any] = {"model": engine.config.model, "device": str(engine.runner.device),
                               "workload": describe(workload).to_dict(), **result.summary(),
                               "compile_s": engine.runner.compile_s,
                               "attention": engine.runner.attention_note,
                               "cold_start_s": first_token[0] - started if first_token else None,
                               "cold_start": _cold_start(session, started, entered, ready,
                                                         first_token)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


def _resume(session: EngineSession, workload: list[WorkloadRequest],
            sink: _OutputSink) -> list[WorkloadRequest]:
    """Resume the journal's unfinished requests; return the part of `workload` that neither
    finished before nor is being resumed."""
    emitted = sink.emitted()
    resumption = session.resume_unfinished(skip=emitted)
    sink.tokens = OutputTokens(resumption.generated)
    assert session.database is not None  # --resume with --no-db is refused up front
    path = session.database.location
    # Said only now: the resume is committed (killed from here on, the next --resume finds
    # the same requests).
    print(f"resumed {len(resumption.resumed)} unfinished request(s) from {path}",
          file=sys.stderr)
    for rid in resumption.quarantined:
        print(f"request {terminal_safe(rid)} QUARANTINED: the process died in every run "
              f"that resumed it; `tokenflow db release-quarantine {terminal_safe(rid)} --db "
              f"{path}` runs it again", file=sys.stderr)
    # Quarantined requests are not run again from the requests file either.
    skip = emitted | set(resumption.resumed) | set(resumption.quarantined)
    return [w for w in workload if w.request_id not in skip]


class _OutputSink:
    """Appends one JSON line per ended request, written and flushed at once so a crash loses
    none. Without --resume the file is new (O_EXCL); with it, a line an earlier run left cut
    short (killed, disk full) is set aside first. A symlink is never followed (O_NOFOLLOW)."""

    def __init__(self, path: Path | None, writer: StoreWriter | None, *,
                 resume: bool = False) -> None:
        self._path = path
        self._writer = writer
        self._fd: int | None = None
        self.tokens = OutputTokens()  # a resumed run's starts from the journal's
        if path is None:
            return
        access = os.O_RDWR if resume else os.O_WRONLY | os.O_EXCL
        self._fd = open_output(path, access | os.O_APPEND)
        if resume:
            _set_aside_torn_line(self._fd, path)

    def emitted(self) -> set[str]:
        """Ids already written (by an earlier, killed run), so none is emitted twice."""
        if self._fd is None:
            return set()
        ids = set()
        for line in _read_all(self._fd).splitlines():
            try:
                ids.add(json.loads(line)["id"])
            except (ValueError, KeyError, TypeError):
                continue  # not one of our lines: that request is resumed instead
        return ids

    def write(self, output: RequestOutput) -> None:
        if self._writer is not None:
            self._writer.check()  # a journal that stopped stops the run (StoreError)
        tokens = self.tokens.add(output)
        if not output.finished:
            return
        if output.state == "FINISHED":
            line = {"id": output.request_id, "token_ids": tokens}
        else:  # REJECTED or FAILED: said, with the reason, rather than silently missing
            print(f"request {terminal_safe(output.request_id)} {output.state}: "
                  f"{terminal_safe(output.finish_reason or '')}", file=sys.stderr)
            line = {"id": output.request_id,
                    "error": {"state": output.state, "reason": output.finish_reason}}
        if self._fd is not None:
            self._append((json.dumps(line) + "\n").encode())

    def _append(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            raise UserError(f"cannot write --output {self._path}: {exc.strerror}; the line "
                            "may be cut short: free space, then finish with --resume (it sets "
                            "the cut line aside)") from exc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _set_aside_torn_line(fd: int, path: Path) -> None:
    """If the file open at `fd` does not end with a whole line, move the fragment to
    PATH.torn and cut it off, so what is appended next starts on a line of its own."""
    try:
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return
        start = size
        while start > 0:  # back to the last newline, a block at a time
            step = min(65536, start)
            cut = os.pread(fd, step, start - step).rfind(b"\n")
            if cut >= 0:
                start = start - step + cut + 1
                break
            start -= step
        fragment = os.pread(fd, size - start, start)
        torn = path.with_name(path.name + ".torn")
        out = os.open(torn, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(out, fragment + b"\n")
        finally:
            os.close(out)
        os.ftruncate(fd, start)
    except OSError as exc:
        raise UserError(f"cannot repair --output {path}: {exc.strerror}") from exc
    print(f"warning: {path} ended with a cut-short line ({len(fragment)} bytes, from a run "
          f"that was killed or ran out of disk); moved it to {torn}", file=sys.stderr)


def _cold_start(session: EngineSession, started: float, entered: float, ready: float,
                first_token: list[float]) -> dict[str, float | None]:
    """Where the seconds to the first token went: imports (process start to the command),
    the engine's start phase by phase (ModelRunner.startup_s), the first calibration, the
    rest of the session's start (store, journal), and the steps to the first token."""
    phases = {f"{name}_s": round(seconds, 3)
              for name, seconds in session.engine.runner.startup_s.items()}
    first = session.first_calibration
    calibration = first.wall_s if first is not None else 0.0
    engine_s = sum(session.engine.runner.startup_s.values())
    return {"import_s": round(entered - started, 3), **phases,
            "first_calibration_s": round(calibration, 3),
            "session_other_s": round(ready - entered - engine_s - calibration, 3),
            "to_first_token_s": round(first_token[0] - ready, 3) if first_token else None,
            "total_s": round(first_token[0] - started, 3) if first_token else None}


def _print_summary(s: dict[str, Any]) -> None:
    def fmt(p: dict[str, float | None]) -> str:
        return " ".join(f"{k}={v:.1f}" if v is not None else f"{k}=-" for k, v in p.items())

    print(f"{s['model']} on {s['device']}: {s['finished']}/{s['requests']} finished "
          f"in {s['wall_s']:.1f} s")
    print(f"  throughput {s['throughput_tok_s']:.1f} tok/s, output {s['output_tok_s']:.1f} tok/s")
    print(f"  TTFT ms {fmt(s['ttft_ms'])}")
    print(f"  TPOT ms {fmt(s['tpot_ms'])}")
    print(f"  step ms {fmt(s['step_ms'])}, preemptions {s['preemptions']}, "
          f"slow queries {s['slow_queries']}"
          + (f" (+{s['slow_queries_sampled']} SLO breaches sampled out)"
             if s.get("slow_queries_sampled") else ""))
    print(f"  attention: {s['attention']}")
    if s["cold_start_s"] is not None:
        print(f"  cold start to first token {s['cold_start_s']:.1f} s "
              f"(compile and warm-up {s['compile_s']:.1f} s)")
