"""Opening the store (SQLite file or PostgreSQL URL): PRAGMAs, schema upgrades, clear failures."""

from __future__ import annotations

import os
import socket
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
from sqlalchemy import URL, Connection, Engine, create_engine, event, make_url
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from engine.errors import EngineError
from engine.store.lock import WriterLock
from engine.store.server_lock import ServerLock

MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
BUSY_TIMEOUT_MS = 5000
SQLITE_HEADER = b"SQLite format 3\x00"
POSTGRESQL_DRIVER = "postgresql+psycopg"
URL_HELP = ("--db takes a SQLite file path or a PostgreSQL URL such as "
            "postgresql+psycopg://user@host:5432/tokenflow")


class StoreError(EngineError):
    """The database file cannot be used; the message names the file and the fix."""


def default_db_path() -> Path:
    return Path(platformdirs.user_data_dir("tokenflow")) / "tokenflow.db"


def default_server_name() -> str:
    """What a process that serves no port writes as: this host."""
    return socket.gethostname()


def store_url(db: str | Path | None) -> URL:
    """The store `db` names: a path (SQLite; default `default_db_path()`) or a database URL."""
    if db is None:
        return URL.create("sqlite", database=str(default_db_path()))
    if isinstance(db, Path) or "://" not in db:
        return URL.create("sqlite", database=str(Path(db).expanduser()))
    if _authority(db).count("@") > 1:  # read as a host, the password's tail would show
        raise StoreError(f"the store URL {_masked(db)} has an '@' in its user or password: "
                         f"write it as %40; {URL_HELP}")
    try:
        url = make_url(db)
    except (ArgumentError, ValueError) as exc:  # a bad port is a ValueError
        raise StoreError(f"cannot read the store URL {_masked(db)}: {exc}; {URL_HELP}") from None
    if url.get_backend_name() == "sqlite":
        if not url.database:
            raise StoreError(f"{_masked(db)} names no file; {URL_HELP}")
        return url.set(drivername="sqlite")
    if url.get_backend_name() != "postgresql":
        raise StoreError(f"{shown_url(url)}: tokenflow stores in "
                         f"SQLite or PostgreSQL only; {URL_HELP}")
    if url.drivername != POSTGRESQL_DRIVER:
        url = url.set(drivername=POSTGRESQL_DRIVER)
    if not url.database:
        raise StoreError(f"{shown_url(url)} names no database; "
                         f"{URL_HELP}")
    return url


def shown_url(url: URL) -> str:
    """`url` as it may be printed: its password, in the user part or the query, as ***."""
    query = {key: "***" if "password" in key.lower() else value
             for key, value in url.query.items()}
    return url.set(query=query).render_as_string(hide_password=True)


def _authority(text: str) -> str:
    """The user, password, host and port of a URL's text."""
    rest = text.partition("://")[2]
    return rest.split("/", 1)[0].split("?", 1)[0]


def _masked(text: str) -> str:
    """A URL we could not parse, with anything that may be a password cut out: the user part
    up to the last '@' of the authority, and every query value."""
    scheme, _, rest = text.partition("://")
    authority = _authority(text)
    path = rest[len(authority):]
    if "@" in authority:
        authority = f"***@{authority.rpartition('@')[2]}"
    path, _, query = path.partition("?")
    return f"{scheme}://{authority}{path}" + ("?***" if query else "")


@dataclass
class Database:
    url: URL
    engine: Engine
    sessions: sessionmaker[Session]
    read_only: bool = False
    server: str = field(default_factory=default_server_name)
    _writer_lock: WriterLock | ServerLock | None = field(default=None, repr=False)

    @property
    def shared(self) -> bool:
        return self.url.get_backend_name() != "sqlite"

    @property
    def path(self) -> Path | None:
        return None if self.shared else Path(str(self.url.database))

    @property
    def location(self) -> str:
        path = self.path
        return str(path) if path is not None else shown_url(self.url)

    def session(self) -> Session:
        return self.sessions()

    def revision(self) -> str | None:
        with explained(self.location), self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

    def claim_writer(self) -> None:
        """Become the one writer of this store (SQLite) or of this server's rows (PostgreSQL)."""
        if self.read_only:
            raise StoreError(f"{self.location} was opened read-only; it cannot be written")
        if self._writer_lock is not None:
            return
        path = self.path
        if path is None:
            with explained(self.location):
                self._writer_lock = ServerLock.acquire(self.engine, self.server, self.location)
            return
        try:
            self._writer_lock = WriterLock.acquire(path)
        except OSError as exc:
            raise StoreError(f"cannot create the lock file beside {path}: "
                             f"{exc.strerror}; {_write_fix(path)}") from exc

    def check_writer(self, connection: Connection) -> None:
        """In a write transaction: raise ServerNameLost if another process took this server's
        name (PostgreSQL); take it back first if it is free (a restart ended our session)."""
        lock = self._writer_lock
        if isinstance(lock, ServerLock) and not lock.check(connection):
            lock.check(connection)  # taken back: the check now sees our new session's lock

    def close(self) -> None:
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None
        self.engine.dispose()


def open_database(path: str | Path | None = None, *, upgrade: bool = True,
                  read_only: bool = False, server: str | None = None) -> Database:
    """Open (creating and upgrading unless `read_only`) the store `path` names; see `store_url`."""
    url = store_url(path)
    if url.get_backend_name() == "sqlite":
        engine = _sqlite_engine(Path(str(url.database)), read_only)
    else:
        engine = create_engine(url, pool_pre_ping=True)
    upgrade = upgrade and not read_only
    database = Database(url, engine, sessionmaker(engine, expire_on_commit=False),
                        read_only=read_only, server=server or default_server_name())
    database.sessions.configure(info={"server": database.server, "shared": database.shared})
    try:
        with explained(database.location):
            known = {script.revision for script in _scripts().walk_revisions()}
            current = database.revision()
            if current is not None and current not in known:
                raise StoreError(
                    f"{database.location} has schema revision {current!r}, which this "
                    "tokenflow does not know: it was written by a newer version. Upgrade "
                    "tokenflow, or pass --db PATH to use another store."
                )
            if upgrade:
                upgrade_database(database)
    except BaseException:
        engine.dispose()
        raise
    return database


def _sqlite_engine(db_path: Path, read_only: bool) -> Engine:
    if read_only:
        if not db_path.is_file():
            raise StoreError(f"{db_path}: no such store; check the path")
        _check_header(db_path)
        engine = _reader_engine(db_path)
    else:
        _check_file(db_path)
        engine = create_engine(f"sqlite:///{db_path}")
        event.listen(engine, "connect", _set_pragmas)
    event.listen(engine, "handle_error", _corruption_is_a_store_error(db_path))
    return engine


def _reader_engine(path: Path) -> Engine:
    """A reader of `path`: plain where SQLite may tidy its WAL, else read-only or immutable."""
    directory_writable = os.access(path.parent, os.W_OK | os.X_OK)
    if directory_writable and os.access(path, os.R_OK | os.W_OK):
        engine = create_engine(f"sqlite:///{path}")
        event.listen(engine, "connect", _set_pragmas)
        return engine
    mode = "ro" if directory_writable else "ro&immutable=1"
    return create_engine(f"sqlite:///file:{urllib.parse.quote(str(path))}?mode={mode}&uri=true")


def upgrade_database(database: Database, revision: str = "head") -> None:
    with explained(database.location), migration_connection(database) as connection:
        command.upgrade(_alembic_config(connection), revision)


def downgrade_database(database: Database, revision: str = "base") -> None:
    with explained(database.location), migration_connection(database) as connection:
        command.downgrade(_alembic_config(connection), revision)


@contextmanager
def migration_connection(database: Database) -> Iterator[Any]:
    """A connection outside any transaction, so Alembic commits one transaction per revision."""
    path = database.path
    if path is None:
        with database.engine.connect() as connection:
            yield connection
        return
    engine = _migration_engine(path)
    try:
        with engine.connect() as connection:
            yield connection
    finally:
        engine.dispose()


def _migration_engine(path: Path) -> Engine:
    """Transactional DDL on SQLite: no implicit BEGIN from pysqlite, our own BEGIN IMMEDIATE."""
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
    event.listen(engine, "handle_error", _corruption_is_a_store_error(path))

    def connect(dbapi_connection: sqlite3.Connection, record: Any) -> None:
        _set_pragmas(dbapi_connection, record)
        dbapi_connection.isolation_level = None

    def begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    event.listen(engine, "connect", connect)
    event.listen(engine, "begin", begin)
    return engine


def head_revision() -> str:
    head = _scripts().get_current_head()
    assert head is not None, f"no Alembic revisions in {MIGRATIONS_DIR}"
    return head


def _alembic_config(connection: Any) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def _scripts() -> ScriptDirectory:
    return ScriptDirectory(str(MIGRATIONS_DIR))


def _set_pragmas(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run while the writer commits; NORMAL sync survives a process crash.
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
def explained(location: str | Path) -> Iterator[None]:
    try:
        yield
    except DBAPIError as exc:
        if "://" in str(location):
            raise _server_error(str(location), exc) from exc
        path = Path(location)
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


def _server_error(location: str, exc: DBAPIError) -> StoreError:
    """A PostgreSQL failure as a StoreError naming the store (never its password)."""
    state = getattr(exc.orig, "sqlstate", None) or ""
    reason = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else type(exc.orig)
    if state in ("42P01", "42703"):  # undefined table or column
        fix = f"its schema is missing tables or columns; run `tokenflow db upgrade --db {location}`"
    elif state.startswith("28"):
        fix = ("check the user, and give the password in PGPASSWORD or ~/.pgpass (a password "
               "in the URL works too, and is never printed)")
    elif state == "3D000":
        fix = "create the database first (createdb), or name another in the URL"
    elif not state or state.startswith("08"):
        fix = ("check that PostgreSQL runs there and accepts connections, and the URL's host "
               "and port")
    else:
        fix = "fix the database or pass --db to use another store"
    return StoreError(f"database {location}: {reason}; {fix}")
