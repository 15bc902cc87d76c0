"""`tokenflow db upgrade|current|release-quarantine`: the SQLite store's schema (upgrade also
runs on every start) and the operator's word that lets a quarantined request run again.

`add_db_argument` is the one `--db` flag every command that touches the store shares.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.orm import Session

from console.cli.terminal import terminal_safe
from console.errors import UserError
from engine.ops.recovery import DISCARDED
from engine.store import discard_unfinished, release_quarantine
from engine.store.database import Database, default_db_path, head_revision, open_database


def add_db_argument(parser: argparse.ArgumentParser, *actions: argparse.ArgumentParser) -> None:
    """`--db` on `parser` and, for a command with actions, on each of them too, so that it
    may come before or after the action (`slow-queries --db F list`, `slow-queries list --db
    F`); there it defaults to nothing rather than overwriting the value given before."""
    help_text = f"SQLite database file (default: {default_db_path()})"
    parser.add_argument("--db", metavar="PATH", default=None, help=help_text)
    for action in actions:
        action.add_argument("--db", metavar="PATH", default=argparse.SUPPRESS, help=help_text)


def open_existing_store(db: str | None) -> Database:
    """The store a read-only command reads, opened read-only: it is never changed (nor
    upgraded), and a read-only file or filesystem is no obstacle. A `--db` naming no file is
    a mistyped path, not an empty store: it is refused rather than created."""
    path = Path(db).expanduser() if db is not None else default_db_path()
    if not path.exists():
        if db is None:  # the default store before anything ran: an empty one, as before
            open_database(path).close()
        else:
            raise UserError(f"{db}: no such store; check the path (tokenflow run, serve and "
                            "tokenflow-console create one with --db)")
    database = open_database(path, read_only=True)
    if database.revision() is None:
        database.close()
        raise UserError(f"{path} holds no tokenflow schema yet; `tokenflow db upgrade --db "
                        f"{path}` creates it")
    return database


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("db", help="manage the SQLite store's schema")
    actions = parser.add_subparsers(dest="db_action", required=True, metavar="ACTION")
    upgrade = actions.add_parser("upgrade", help="upgrade the schema to the newest revision")
    upgrade.set_defaults(func=run_upgrade)
    current = actions.add_parser("current", help="show the schema revision, without changing it")
    current.set_defaults(func=run_current)
    release = actions.add_parser(
        "release-quarantine", help="let a quarantined request run again (the next resume "
        "takes it); `tokenflow slow-queries list` shows quarantined requests")
    release.add_argument("request_id", metavar="ID", help="the quarantined request's id")
    release.set_defaults(func=run_release_quarantine)
    discard = actions.add_parser(
        "discard-unfinished", help="close every unfinished request in the journal, so no run "
        "resumes them (e.g. a journal written by another model)")
    discard.set_defaults(func=run_discard_unfinished)
    add_db_argument(parser, upgrade, current, release, discard)


def run_upgrade(args: argparse.Namespace) -> int:
    database = open_database(args.db, upgrade=True)
    try:
        print(f"{database.location}: schema at revision {database.revision()} (head)")
    finally:
        database.close()
    return 0


def run_current(args: argparse.Namespace) -> int:
    database = open_existing_store(args.db)
    try:
        revision = database.revision()
    finally:
        database.close()
    head = head_revision()
    state = "up to date" if revision == head else f"behind {head}; run `tokenflow db upgrade`"
    print(f"{database.location}: schema at revision {revision or 'none (empty)'}, {state}")
    return 0


@contextmanager
def _journal_write(db: str | None) -> Iterator[tuple[Database, Session]]:
    """An existing store, held as its one writer: not while a run or server owns it."""
    if db is not None and not Path(db).expanduser().exists():
        raise UserError(f"{db}: no such store; check the path")
    database = open_database(db)
    try:
        database.claim_writer()
        with database.session() as session:
            yield database, session
    finally:
        database.close()


def run_release_quarantine(args: argparse.Namespace) -> int:
    with _journal_write(args.db) as (database, session):
        released = release_quarantine(session, args.request_id)
    rid = terminal_safe(args.request_id)
    if not released:
        raise UserError(f"no quarantined request {rid!r} in {database.location}; `tokenflow "
                        "slow-queries list` shows the quarantined ones")
    print(f"request {rid} released: the next `tokenflow run --resume`, `serve` or console "
          f"on {database.location} runs it again")
    return 0


def run_discard_unfinished(args: argparse.Namespace) -> int:
    with _journal_write(args.db) as (database, session):
        discarded = discard_unfinished(session, DISCARDED)
    print(f"discarded {len(discarded)} unfinished request(s) in {database.location}")
    return 0
