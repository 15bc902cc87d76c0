"""`tokenflow run`: drive a workload to the end headless and print a summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from console.errors import UserError
from console.commands.engine_flags import add_engine_flags, engine_config
from console.commands.workload_flags import add_workload_flags, workload_for
from engine.driver import drive
from engine.engine import Engine, RequestOutput
from engine.workload import describe, load_requests_jsonl


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="drive a workload to the end headless",
                                   description=__doc__)
    add_engine_flags(parser)
    add_workload_flags(parser)
    parser.add_argument("--requests", type=Path, help="JSONL requests (id, prompt_token_ids or "
                        "prompt, max_tokens, optional tenant) instead of --workload")
    parser.add_argument("--output", type=Path, help="write finished requests here as JSONL "
                        "(id, token_ids)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    engine = Engine(engine_config(args))
    if args.requests:
        if not args.requests.exists():
            raise UserError(f"--requests {args.requests}: no such file")
        workload = load_requests_jsonl(args.requests, engine.tokenizer.encode)
    else:
        workload = workload_for(args, engine)
    sink = _OutputSink(args.output)
    try:
        result = drive(engine, workload, on_output=sink.write)
    finally:
        sink.close()
    summary: dict[str, Any] = {"model": engine.config.model, "device": str(engine.runner.device),
                               "workload": describe(workload).to_dict(), **result.summary()}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


class _OutputSink:
    """Appends one JSON line per finished request, flushed at once so a crash loses none."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("a") if path else None

    def write(self, output: RequestOutput) -> None:
        if self._file is not None and output.finished and output.state == "FINISHED":
            self._file.write(json.dumps({"id": output.request_id,
                                         "token_ids": list(output.token_ids)}) + "\n")
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
