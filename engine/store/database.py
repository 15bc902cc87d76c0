"""Opening the SQLite store: PRAGMAs on every connection, schema upgrades, clear failures.

The store is only ever opened through `open_database`, which refuses a file it cannot use
(corrupt, written by a newer tokenflow, not writable) with a StoreError that names the file
and the fix. It never deletes, moves or rewrites such a file. Corruption found later, in a
page the open did not read, is the same StoreError wherever a query meets it. Read-only
commands open the store read-only, so a read-only file or filesystem still serves them.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from engine.errors import EngineError
from engine.store.lock import WriterLock

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
    read_only: bool = False
    _writer_lock: WriterLock | None = field(default=None, repr=False)

    def session(self) -> Session:
        return self.sessions()

    def revision(self) -> str | None:
        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

    def claim_writer(self) -> None:
        """Become the store's one writer (see engine/store/lock.py) until `close()`; raises
        StoreLockedError naming the process that already is. Whoever journals calls it
        first: the StoreWriter and crash recovery do; calling it again is a no-op."""
        if self.read_only:
            raise StoreError(f"{self.path} was opened read-only; it cannot be written")
        if self._writer_lock is None:
            try:
                self._writer_lock = WriterLock.acquire(self.path)
            except OSError as exc:
                raise StoreError(f"cannot create the lock file beside {self.path}: "
                                 f"{exc.strerror}; {_write_fix(self.path)}") from exc

    def close(self) -> None:
        self.engine.dispose()
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None


def open_database(path: str | Path | None = None, *, upgrade: bool = True,
                  read_only: bool = False) -> Database:
    """Open (creating if needed) the store at `path`, default `default_db_path()`.

    With `upgrade`, the schema is brought to the newest revision first, as on every start.
    `read_only` opens an existing file for reading only: nothing is created or upgraded,
    and a read-only file, directory or filesystem is no obstacle.
    """
    db_path = Path(path).expanduser() if path is not None else default_db_path()
    if read_only:
        if not db_path.is_file():
            raise StoreError(f"{db_path}: no such store; check the path")
        _check_header(db_path)
        engine = _reader_engine(db_path)
        upgrade = False
    else:
        _check_file(db_path)
        engine = create_engine(f"sqlite:///{db_path}")
        event.listen(engine, "connect", _set_pragmas)
    event.listen(engine, "handle_error", _corruption_is_a_store_error(db_path))
    database = Database(db_path, engine, sessionmaker(engine, expire_on_commit=False),
                        read_only=read_only)
    try:
        with explained(db_path):
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


def _reader_engine(path: Path) -> Engine:
    """An engine that only reads `path`: a plain connection where SQLite may tidy its WAL
    files up, else a read-only one, immutable where not even those files can be made."""
    directory_writable = os.access(path.parent, os.W_OK | os.X_OK)
    if directory_writable and os.access(path, os.R_OK | os.W_OK):
        engine = create_engine(f"sqlite:///{path}")
        event.listen(engine, "connect", _set_pragmas)
        return engine
    mode = "ro" if directory_writable else "ro&immutable=1"
    return create_engine(f"sqlite:///file:{urllib.parse.quote(str(path))}?mode={mode}&uri=true")


def upgrade_database(database: Database, revision: str = "head") -> None:
    with explained(database.path), database.engine.begin() as connection:
        config = _alembic_config(connection)
        command.upgrade(config, revision)


def downgrade_database(database: Database, revision: str = "base") -> None:
    with explained(database.path), database.engine.begin() as connection:
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
            f"{exc.strerror}; {_write_fix(path)}"
        ) from exc
    if path.exists():
        if not path.is_file():
            raise StoreError(f"{path} is not a file; {fix}.")
        _check_header(path)
        if _read_only_filesystem(directory):
            raise StoreError(f"cannot write the database {path}: {_write_fix(path)}")
        if not os.access(path, os.R_OK | os.W_OK):
            raise StoreError(
                f"no permission to read and write the database {path}; fix its permissions "
                f"(chmod u+rw {path}), {fix}."
            )
    # SQLite keeps its WAL and shared-memory files next to the database.
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StoreError(
            f"no permission to write in {directory}, where the database {path} and its WAL "
            f"files live; {_write_fix(path)}"
        )


def _check_header(path: Path) -> None:
    with path.open("rb") as handle:
        header = handle.read(len(SQLITE_HEADER))
    if header and header != SQLITE_HEADER:
        raise _corrupt(path)


def _read_only_filesystem(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _write_fix(path: Path) -> str:
    """How to get a writable store: permissions can be fixed, a read-only mount cannot."""
    directory = path.parent if path.parent.exists() else path.parent.parent
    if _read_only_filesystem(directory):
        return ("its filesystem is mounted read-only; pass --db PATH to put the store on a "
                "writable one (read-only commands such as `tokenflow slow-queries list` "
                "still read it where it is).")
    return ("fix the permissions of the file and its directory, or pass --db PATH to use "
            "another file.")


def _corruption_is_a_store_error(path: Path) -> Any:
    """A handle_error hook: corruption met in any query is the one clear StoreError."""
    def handle(context: ExceptionContext) -> StoreError | None:
        original = context.original_exception
        name = getattr(original, "sqlite_errorname", "")
        if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
            return _corrupt(path)
        return None
    return handle


def _corrupt(path: Path) -> StoreError:
    return StoreError(
        f"{path} is not a SQLite database or is corrupt. It was left untouched: move it aside "
        f"(mv {path} {path}.bad) to start a fresh one there, or pass --db PATH to use another file."
    )


@contextmanager
def explained(path: Path) -> Iterator[None]:
    """Turn SQLite's terse failures into errors naming the file and the fix."""
    try:
        yield
    except DBAPIError as exc:
        message = str(exc.orig).lower()
        if "not a database" in message or "malformed" in message:
            raise _corrupt(path) from exc
        if "no such table" in message or "no such column" in message or "has no column" in message:
            raise StoreError(
                f"database {path} ({exc.orig}): its schema is missing tables or columns; run "
                f"`tokenflow db upgrade --db {path}`, or pass --db PATH to use another file"
            ) from exc
        if "readonly" in message or "unable to open" in message or "permission" in message:
            raise StoreError(
                f"cannot write the database {path} ({exc.orig}); {_write_fix(path)}"
            ) from exc
        raise StoreError(f"database {path}: {exc.orig}") from exc
