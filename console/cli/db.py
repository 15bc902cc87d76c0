"""`tokenflow db upgrade|current`: the SQLite store's schema (upgrade also runs on every start).

`add_db_argument` is the one `--db` flag every command that touches the store shares.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from console.errors import UserError
from engine.store.database import Database, default_db_path, head_revision, open_database


def add_db_argument(parser: argparse.ArgumentParser, *actions: argparse.ArgumentParser) -> None:
    """`--db` on `parser` and, for a command with actions, on each of them too, so that it
    may come before or after the action (`slow-queries --db F list`, `slow-queries list --db
    F`); there it defaults to nothing rather than overwriting the value given before."""
    help_text = f"SQLite database file (default: {default_db_path()})"
    parser.add_argument("--db", metavar="PATH", default=None, help=help_text)
    for action in actions:
        action.add_argument("--db", metavar="PATH", default=argparse.SUPPRESS, help=help_text)


def open_existing_store(db: str | None, *, upgrade: bool = True) -> Database:
    """The store a read-only command reads. A `--db` naming no file is a mistyped path, not
    an empty store: it is refused rather than created."""
    if db is not None and not Path(db).expanduser().exists():
        raise UserError(f"{db}: no such store; check the path (tokenflow run, serve and "
                        "tokenflow-console create one with --db)")
    return open_database(db, upgrade=upgrade)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("db", help="manage the SQLite store's schema")
    actions = parser.add_subparsers(dest="db_action", required=True, metavar="ACTION")
    upgrade = actions.add_parser("upgrade", help="upgrade the schema to the newest revision")
    upgrade.set_defaults(func=run_upgrade)
    current = actions.add_parser("current", help="show the schema revision, without changing it")
    current.set_defaults(func=run_current)
    add_db_argument(parser, upgrade, current)


def run_upgrade(args: argparse.Namespace) -> int:
    database = open_database(args.db, upgrade=True)
    try:
        print(f"{database.path}: schema at revision {database.revision()} (head)")
    finally:
        database.close()
    return 0


def run_current(args: argparse.Namespace) -> int:
    database = open_existing_store(args.db, upgrade=False)
    try:
        revision = database.revision()
    finally:
        database.close()
    head = head_revision()
    state = "up to date" if revision == head else f"behind {head}; run `tokenflow db upgrade`"
    print(f"{database.path}: schema at revision {revision or 'none (empty)'}, {state}")
    return 0
