"""Opening the SQLite store: PRAGMAs on every connection, schema upgrades, clear failures.

The store is only ever opened through `open_database`, which refuses a file it cannot use
(corrupt, written by a newer tokenflow, not writable) with a StoreError that names the file
and the fix. It never deletes, moves or rewrites such a file.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from engine.errors import EngineError

# Package data beside this module, so an installed wheel migrates as a checkout does.
MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
BUSY_TIMEOUT_MS = 5000  # the longest a writer waits for another process's lock
SQLITE_HEADER = b"SQLite format 3\x00"


class StoreError(EngineError):
    """The database file cannot be used; the message names the file and the fix."""


def default_db_path() -> Path:
    return Path(platformdirs.user_data_dir("tokenflow")) / "tokenflow.db"


@dataclass
class Database:
    path: Path
    engine: Engine
    sessions: sessionmaker[Session]

    def session(self) -> Session:
        return self.sessions()

    def revision(self) -> str | None:
        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

    def close(self) -> None:
        self.engine.dispose()


def open_database(path: str | Path | None = None, *, upgrade: bool = True) -> Database:
    """Open (creating if needed) the store at `path`, default `default_db_path()`.

    With `upgrade`, the schema is brought to the newest revision first, as on every start.
    """
    db_path = Path(path).expanduser() if path is not None else default_db_path()
    _check_file(db_path)
    engine = create_engine(f"sqlite:///{db_path}")
    event.listen(engine, "connect", _set_pragmas)
    database = Database(db_path, engine, sessionmaker(engine, expire_on_commit=False))
    try:
        with _explained(db_path):
            known = {script.revision for script in _scripts().walk_revisions()}
            current = database.revision()
            if current is not None and current not in known:
                raise StoreError(
                    f"{db_path} has schema revision {current!r}, which this tokenflow does not "
                    "know: it was written by a newer version. Upgrade tokenflow, or pass "
                    "--db PATH to use another file."
                )
            if upgrade:
                upgrade_database(database)
    except BaseException:
        engine.dispose()
        raise
    return database


def upgrade_database(database: Database, revision: str = "head") -> None:
    with _explained(database.path), database.engine.begin() as connection:
        config = _alembic_config(connection)
        command.upgrade(config, revision)


def downgrade_database(database: Database, revision: str = "base") -> None:
    with _explained(database.path), database.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), revision)


def head_revision() -> str:
    head = _scripts().get_current_head()
    assert head is not None, f"no Alembic revisions in {MIGRATIONS_DIR}"
    return head


def _alembic_config(connection: Any) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection  # env.py migrates on our connection
    return config


def _scripts() -> ScriptDirectory:
    return ScriptDirectory(str(MIGRATIONS_DIR))


def _set_pragmas(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers (console, CLI) run while the writer thread commits; NORMAL sync is
    # durable across a process crash, which is what the journal must survive.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.close()


def _check_file(path: Path) -> None:
    """Refuse, before SQLite touches it, a file we could not use or would damage."""
    directory = path.parent
    fix = "or pass --db PATH to use another file"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot create the directory {directory} for the database {path}: "
            f"{exc.strerror}; create it yourself with write permission, {fix}."
        ) from exc
    if path.exists():
        if not path.is_file():
            raise StoreError(f"{path} is not a file; {fix}.")
        with path.open("rb") as handle:
            header = handle.read(len(SQLITE_HEADER))
        if header and header != SQLITE_HEADER:
            raise _corrupt(path)
        if not os.access(path, os.R_OK | os.W_OK):
            raise StoreError(
                f"no permission to read and write the database {path}; fix its permissions "
                f"(chmod u+rw {path}), {fix}."
            )
    # SQLite keeps its WAL and shared-memory files next to the database.
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StoreError(
            f"no permission to write in {directory}, where the database {path} and its WAL "
            f"files live; fix the directory's permissions, {fix}."
        )


def _corrupt(path: Path) -> StoreError:
    return StoreError(
        f"{path} is not a SQLite database or is corrupt. It was left untouched: move it aside "
        f"(mv {path} {path}.bad) to start a fresh one there, or pass --db PATH to use another file."
    )


@contextmanager
def _explained(path: Path) -> Iterator[None]:
    """Turn SQLite's terse failures into errors naming the file and the fix."""
    try:
        yield
    except DBAPIError as exc:
        message = str(exc.orig).lower()
        if "not a database" in message or "malformed" in message:
            raise _corrupt(path) from exc
        if "readonly" in message or "unable to open" in message or "permission" in message:
            raise StoreError(
                f"cannot write the database {path} ({exc.orig}); fix the permissions of the "
                "file and its directory, or pass --db PATH to use another file."
            ) from exc
        raise StoreError(f"database {path}: {exc.orig}") from exc
