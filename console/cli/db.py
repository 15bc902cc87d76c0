"""`tokenflow db upgrade|current|release-quarantine`: the store's schema (upgrade also runs
on every start) and the operator's word that lets a quarantined request run again.

`add_db_argument` is the one `--db` flag every command that touches the store shares: a
SQLite file or a PostgreSQL URL; `add_server_name_argument` the name a writer's rows carry.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from console.cli.terminal import terminal_safe
from console.errors import UserError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from engine.store.database import Database

# The store's code (SQLAlchemy, Alembic) is imported by the functions that open it: every
# command registers --db, and one that never opens the store (a simulated bench on a named
# GPU) should not pay for importing it.


def add_db_argument(parser: argparse.ArgumentParser, *actions: argparse.ArgumentParser) -> None:
    """`--db` on `parser` and, for a command with actions, on each of them too, so that it
    may come before or after the action (`slow-queries --db F list`, `slow-queries list --db
    F`); there it defaults to nothing rather than overwriting the value given before."""
    help_text = ("the store: a SQLite file (default: tokenflow.db in the user data directory) "
                 "or a PostgreSQL URL a fleet shares, postgresql+psycopg://user@host:5432/db "
                 "(password from PGPASSWORD or ~/.pgpass)")
    parser.add_argument("--db", metavar="PATH|URL", default=None, help=help_text)
    for action in actions:
        action.add_argument("--db", metavar="PATH|URL", default=argparse.SUPPRESS,
                            help=help_text)


def add_server_name_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """`--server-name`: the name every row this process writes carries; one process writes
    as a name at a time, so servers sharing a PostgreSQL store need names of their own."""
    parser.add_argument("--server-name", metavar="NAME", default=None,
                        help=f"the name this process's rows carry in the store (default: "
                        f"{default}); one writer per name")


def refuse_store_flags_without_a_store(args: argparse.Namespace) -> None:
    """--db, --server-name (and run's --report-commits) need the store that --no-db turns
    off: given together, refused."""
    named = [flag for flag, value in (("--db", args.db), ("--server-name", args.server_name),
                                      ("--report-commits",
                                       getattr(args, "report_commits", None) or None))
             if value is not None]
    if args.no_db and named:
        raise UserError(f"{' and '.join(named)} need{'s' if len(named) == 1 else ''} the store "
                        "that --no-db turns off; drop one or the other")


def _missing_file(db: str | None) -> Path | None:
    """The SQLite file `db` names when it does not exist; None for a URL or a file."""
    from engine.store.database import store_url
    url = store_url(db)
    if url.get_backend_name() != "sqlite":
        return None
    path = Path(str(url.database))
    return None if path.exists() else path


def open_existing_store(db: str | None) -> Database:
    """The store a read-only command reads, opened read-only: it is never changed (nor
    upgraded), and a read-only file or filesystem is no obstacle. A `--db` naming no file is
    a mistyped path, not an empty store: it is refused rather than created."""
    from engine.store.database import open_database
    missing = _missing_file(db)
    if missing is not None:
        if db is None:  # the default store before anything ran: an empty one, as before
            open_database(missing).close()
        else:
            raise UserError(f"{db}: no such store; check the path (tokenflow run, serve and "
                            "tokenflow-console create one with --db)")
    database = open_database(db, read_only=True)
    if database.revision() is None:
        database.close()
        raise UserError(f"{database.location} holds no tokenflow schema yet; `tokenflow db "
                        f"upgrade --db {database.location}` creates it")
    return database


def refuse_store_files(output: Path, db: str | None) -> None:
    """An --output may not name the store or the files SQLite keeps beside it: writing
    there would replace the database. Checked before anything is written."""
    from engine.store.database import store_url
    from engine.store.lock import lock_path
    url = store_url(db)
    if url.get_backend_name() != "sqlite":
        return  # a database server's files are not local paths
    store = Path(str(url.database))
    for path in (store, store.with_name(store.name + "-wal"),
                 store.with_name(store.name + "-shm"), lock_path(store)):
        if output.resolve() == path.resolve() or (
                output.exists() and path.exists() and os.path.samefile(output, path)):
            raise UserError(f"--output {output} is the store {store} (or a file SQLite keeps "
                            "beside it); choose another --output")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("db", help="manage the store's schema")
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
    for action in (release, discard):  # in a shared store, whose journal entries
        add_server_name_argument(action, "this host")


def run_upgrade(args: argparse.Namespace) -> int:
    from engine.store.database import open_database
    database = open_database(args.db, upgrade=True)
    try:
        print(f"{database.location}: schema at revision {database.revision()} (head)")
    finally:
        database.close()
    return 0


def run_current(args: argparse.Namespace) -> int:
    from engine.store.database import head_revision
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
def _journal_write(db: str | None, server: str | None,
                   ) -> Iterator[tuple[Database, Session]]:
    """An existing store, held as its one writer (of `server`'s rows, in a shared store):
    not while a run or server owns it."""
    from engine.store.database import open_database
    if db is not None and _missing_file(db) is not None:
        raise UserError(f"{db}: no such store; check the path")
    database = open_database(db, server=server)
    try:
        database.claim_writer()
        with database.session() as session:
            yield database, session
    finally:
        database.close()


def run_release_quarantine(args: argparse.Namespace) -> int:
    from engine.store import release_quarantine
    with _journal_write(args.db, args.server_name) as (database, session):
        released = release_quarantine(session, args.request_id)
    rid = terminal_safe(args.request_id)
    if not released:
        raise UserError(f"no quarantined request {rid!r} in {database.location}; `tokenflow "
                        "slow-queries list` shows the quarantined ones")
    print(f"request {rid} released: the next `tokenflow run --resume`, `serve` or console "
          f"on {database.location} runs it again")
    return 0


def run_discard_unfinished(args: argparse.Namespace) -> int:
    from engine.store import discard_unfinished
    from engine.store.recovery import DISCARDED  # the engine (torch): only for this action

    with _journal_write(args.db, args.server_name) as (database, session):
        discarded = discard_unfinished(session, DISCARDED)
    print(f"discarded {len(discarded)} unfinished request(s) in {database.location}")
    return 0
