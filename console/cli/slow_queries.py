"""`tokenflow slow-queries list|show|export`: requests whose budget_score crossed the threshold."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from console.cli.db import add_db_argument, open_existing_store, refuse_store_files
from console.cli.output_file import check_output, open_output
from console.cli.terminal import terminal_safe
from console.errors import UserError
from engine.ops.timeline import timeline_lines
from engine.stats import human_duration
from engine.store import QuarantinedRequest, quarantined_requests
from engine.store.slow_queries import (
    EXPORT_FORMATS,
    SORT_FIELDS,
    SlowQueryRecord,
    export_slow_queries,
    get_slow_query,
    list_slow_queries,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("slow-queries", help="list, show and export slow queries")
    actions = parser.add_subparsers(dest="slow_action", required=True, metavar="ACTION")

    listing = actions.add_parser("list", help="a table of slow queries")
    _add_filters(listing)
    listing.add_argument("--limit", type=int, default=50, help="rows to show (default 50)")
    listing.add_argument("--after", type=int, metavar="ID",
                         help="the next page: the rows after the one with this id (the last "
                         "one listed), in the same order")
    listing.add_argument("--json", action="store_true",
                         help="one JSON object: the page's records (as export writes them), "
                         "the --after of the next page and the quarantined requests")
    listing.set_defaults(func=run_list)

    show = actions.add_parser("show", help="one slow query with its chunks and configuration")
    show.add_argument("id", type=int, help="the slow query's id (first column of `list`)")
    show.add_argument("--json", action="store_true",
                      help="the whole record as JSON: timeline, cause, share and verdict")
    show.set_defaults(func=run_show)

    export = actions.add_parser("export", help="every matching slow query as CSV or JSON")
    _add_filters(export)
    export.add_argument("--format", choices=EXPORT_FORMATS, required=True)
    export.add_argument("--output", metavar="FILE",
                        help="write here instead of stdout: a new file (never through a "
                             "symlink), or an existing one with --overwrite")
    export.add_argument("--overwrite", action="store_true",
                        help="with --output: replace the file if it exists")
    export.add_argument("--limit", type=int, default=None, help="at most this many rows")
    export.set_defaults(func=run_export)
    add_db_argument(parser, listing, show, export)


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sort", choices=list(SORT_FIELDS), default="score",
                        help="order by (default score, highest first)")
    parser.add_argument("--tenant", help="only this tenant")
    parser.add_argument("--server", metavar="NAME",
                        help="only this server's (its --server-name; default: every server "
                        "sharing the store)")
    parser.add_argument("--min-score", type=float, help="only budget_score at least this")


SQLITE_INT_MAX = 2**63 - 1  # the largest LIMIT or id SQLite can take


def _select(args: argparse.Namespace,
            ) -> tuple[list[SlowQueryRecord], list[QuarantinedRequest]]:
    if args.limit is not None and not 1 <= args.limit <= SQLITE_INT_MAX:
        raise UserError(f"--limit must be between 1 and {SQLITE_INT_MAX}, got {args.limit}")
    after = getattr(args, "after", None)  # export takes no pages
    if after is not None and not 0 <= after <= SQLITE_INT_MAX:
        raise UserError(f"--after takes a slow query's id (the last one listed), got {after}")
    if args.min_score is not None and not math.isfinite(args.min_score):
        raise UserError(f"--min-score must be a finite number, got {args.min_score}")
    database = open_existing_store(args.db)
    try:
        with database.session() as session:
            records = list_slow_queries(session, sort=args.sort, tenant=args.tenant,
                                        server=args.server, min_score=args.min_score,
                                        limit=args.limit, after=after)
            return records, quarantined_requests(session)
    finally:
        database.close()


def run_list(args: argparse.Namespace) -> int:
    records, quarantined = _select(args)
    next_after = records[-1].id if records and len(records) == args.limit else None
    if args.json:
        print(json.dumps({"slow_queries": [asdict(r) for r in records],
                          "next_after": next_after,
                          "quarantined": [asdict(q) for q in quarantined]}, indent=2))
        return 0
    if not records:
        print("no slow queries recorded")
    else:
        # RESUMED: the output tokens a request had when resumed from the journal after a
        # restart (0: it stopped mid-prefill); "-" for one that never was
        # RULES: which rules stored it; N: the SLO breaches a sampled row stands for
        header = ("ID", "WHEN", "TENANT", "RULES", "N", "FELT", "CAUSE", "SCORE", "PROMPT",
                  "PREFILL_MS", "BUDGET_MS", "CHUNKS", "RESUMED", "TAG", "SERVER", "REQUEST")
        _table(header, [
            (str(r.id), _when(r.created_at), r.tenant, r.rules, str(r.represents),
             r.felt_part or "-", r.felt_cause or r.cause or "-",
             "-" if r.budget_score is None else f"{r.budget_score:.2f}",
             str(r.prompt_tokens), f"{r.prefill_s * 1e3:.1f}", f"{r.budgeted_s * 1e3:.1f}",
             str(len(r.chunks)), "-" if r.resumed_tokens is None else str(r.resumed_tokens),
             r.tag or "-", r.server or "-", r.request_id)
            for r in records
        ])
    if next_after is not None:  # on stderr: stdout stays one table
        print(f"next page: --after {next_after}", file=sys.stderr)
    if quarantined:
        print(f"\nquarantined requests ({len(quarantined)}): not run again until "
              "`tokenflow db release-quarantine ID`")
        _table(("REQUEST", "WHEN", "TENANT", "PROMPT", "GENERATED", "TAG"), [
            (q.request_id, _when(q.updated_at), q.tenant, str(q.prompt_tokens),
             str(q.generated_tokens), q.tag or "-")
            for q in quarantined
        ])
    return 0


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> None:
    """Left-aligned columns; cells from outside are made terminal-safe first."""
    safe = [tuple(terminal_safe(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in (header, *safe)) for i in range(len(header))]
    for row in (header, *safe):
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())


def run_show(args: argparse.Namespace) -> int:
    if not 1 <= args.id <= SQLITE_INT_MAX:
        raise UserError(f"no slow query with id {args.id}; `tokenflow slow-queries list` "
                        "shows ids")
    database = open_existing_store(args.db)
    try:
        with database.session() as session:
            record = get_slow_query(session, args.id)
    finally:
        database.close()
    if record is None:
        raise UserError(f"no slow query with id {args.id}; `tokenflow slow-queries list` shows ids")
    if args.json:
        print(json.dumps(asdict(record), indent=2))
        return 0
    print(f"slow query {record.id}  request {terminal_safe(record.request_id)}  tenant "
          f"{terminal_safe(record.tenant)}  tag {terminal_safe(record.tag or '-')}  at "
          f"{_when(record.created_at)}")
    print(f"stored by {record.rules}"
          + (f", standing for {record.represents} requests" if record.represents > 1 else ""))
    if record.verdict:  # its lines: what the user felt and why, then the budget_score
        first, *rest = record.verdict.split("\n")
        felt = record.felt_cause is not None  # rows before 0011: one line, the overrun's
        print(f"verdict: {terminal_safe(first)}"
              + (_cause_tag(record.felt_cause, record.felt_share) if felt
                 else _cause_tag(record.cause, record.cause_share)))
        for i, line in enumerate(rest):  # the budget_score's line: the overrun's cause
            tag = _cause_tag(record.cause, record.cause_share) if felt and i == 0 else ""
            print(f"         {terminal_safe(line)}{tag}")
    if record.budget_score is not None and not record.verdict:  # a row from before 0004
        print(f"budget_score {record.budget_score:.2f}: prefill "
              f"{human_duration(record.prefill_s)} against a budget of "
              f"{human_duration(record.budgeted_s)}")
    print(record.prompt_words())
    if record.timeline:
        _print_timeline(record.timeline)
    print(f"chunks ({len(record.chunks)}):")
    _print_chunks(record.chunks)
    print("configuration at the time:")
    print(json.dumps(record.config, indent=2, sort_keys=True))  # ASCII: escapes are escaped
    return 0


def _cause_tag(cause: str | None, share: float | None) -> str:
    if cause is None:
        return ""
    return f"  [cause {cause}{f', {share:.0%}' if share is not None else ''}]"


def _print_timeline(t: dict[str, Any]) -> None:
    print("timeline (instants from arrival):")
    for line in timeline_lines(t):
        print(f"  {line}")


def _print_chunks(chunks: list[dict[str, Any]]) -> None:
    header = ("#", "AT", "START", "TOKENS", "STEP", "MEASURED", "PREDICTED", "PLANNED",
              "DECODES", "OTHER_TOK", "MODE")
    rows = [(str(c.get("index", "")), human_duration(c.get("at_s")), str(c.get("start", "")),
             str(c.get("tokens", "")), str(c.get("step", "–")), human_duration(c.get("duration_s")),
             human_duration(c.get("predicted_s")), human_duration(c.get("planned_s")),
             str(c.get("decodes", "–")), str(c.get("other_prefill_tokens", "–")),
             c.get("mode", "–") + (" (recomputed)" if c.get("recomputed") else ""))
            for c in chunks]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def run_export(args: argparse.Namespace) -> int:
    if args.overwrite and args.output is None:
        raise UserError("--overwrite replaces an --output file; add --output FILE")
    if args.output is not None:  # before the store is read
        refuse_store_files(Path(args.output), args.db)
        check_output(Path(args.output), may_exist=args.overwrite,
                     keep_hint="pass --overwrite to replace it")
    records, _ = _select(args)
    text = export_slow_queries(records, args.format)
    if args.output is None:
        print(text, end="")
        return 0
    flags = os.O_WRONLY | (os.O_TRUNC if args.overwrite else os.O_EXCL)
    fd = open_output(Path(args.output), flags)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        message = f"cannot write {args.output}: {exc.strerror}; choose another --output"
        raise UserError(message) from exc
    return 0


def _when(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s).strftime("%Y-%m-%d %H:%M:%S")
