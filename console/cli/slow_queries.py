"""`tokenflow slow-queries list|show|export`: requests whose budget_score crossed the threshold."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from console.cli.db import add_db_argument, open_existing_store
from console.errors import UserError
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
    listing.set_defaults(func=run_list)

    show = actions.add_parser("show", help="one slow query with its chunks and configuration")
    show.add_argument("id", type=int, help="the slow query's id (first column of `list`)")
    show.set_defaults(func=run_show)

    export = actions.add_parser("export", help="every matching slow query as CSV or JSON")
    _add_filters(export)
    export.add_argument("--format", choices=EXPORT_FORMATS, required=True)
    export.add_argument("--output", metavar="FILE", help="write here instead of stdout")
    export.add_argument("--limit", type=int, default=None, help="at most this many rows")
    export.set_defaults(func=run_export)
    add_db_argument(parser, listing, show, export)


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sort", choices=list(SORT_FIELDS), default="score",
                        help="order by (default score, highest first)")
    parser.add_argument("--tenant", help="only this tenant")
    parser.add_argument("--min-score", type=float, help="only budget_score at least this")


def _select(args: argparse.Namespace) -> list[SlowQueryRecord]:
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be at least 1, got {args.limit}")
    database = open_existing_store(args.db)
    try:
        with database.session() as session:
            return list_slow_queries(session, sort=args.sort, tenant=args.tenant,
                                     min_score=args.min_score, limit=args.limit)
    finally:
        database.close()


def run_list(args: argparse.Namespace) -> int:
    records = _select(args)
    if not records:
        print("no slow queries recorded")
        return 0
    header = ("ID", "WHEN", "TENANT", "SCORE", "PROMPT", "PREFILL_MS", "BUDGET_MS", "CHUNKS",
              "TAG", "REQUEST")
    rows = [
        (str(r.id), _when(r.created_at), r.tenant, f"{r.budget_score:.2f}", str(r.prompt_tokens),
         f"{r.prefill_s * 1e3:.1f}", f"{r.budgeted_s * 1e3:.1f}", str(len(r.chunks)),
         r.tag or "-", r.request_id)
        for r in records
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())
    return 0


def run_show(args: argparse.Namespace) -> int:
    database = open_existing_store(args.db)
    try:
        with database.session() as session:
            record = get_slow_query(session, args.id)
    finally:
        database.close()
    if record is None:
        raise UserError(f"no slow query with id {args.id}; `tokenflow slow-queries list` shows ids")
    print(f"slow query {record.id}  request {record.request_id}  tenant {record.tenant}"
          f"  tag {record.tag or '-'}  at {_when(record.created_at)}")
    print(f"budget_score {record.budget_score:.2f}: prefill {record.prefill_s * 1e3:.1f} ms "
          f"against a budget of {record.budgeted_s * 1e3:.1f} ms, {record.prompt_tokens} "
          "prompt tokens")
    print(f"chunks ({len(record.chunks)}):")
    for chunk in record.chunks:
        print("  " + "  ".join(f"{key}={value}" for key, value in chunk.items()))
    print("configuration at the time:")
    print(json.dumps(record.config, indent=2, sort_keys=True))
    return 0


def run_export(args: argparse.Namespace) -> int:
    text = export_slow_queries(_select(args), args.format)
    if args.output is None:
        print(text, end="")
        return 0
    try:
        Path(args.output).write_text(text)
    except OSError as exc:
        message = f"cannot write {args.output}: {exc.strerror}; choose another --output"
        raise UserError(message) from exc
    return 0


def _when(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s).strftime("%Y-%m-%d %H:%M:%S")
