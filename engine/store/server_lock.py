"""One writer per server name in a shared PostgreSQL store: a session advisory lock, checked
in every write batch's own transaction.

The lock is held by one connection's session; if that session ends (the connection was
killed, or PostgreSQL restarted) the lock is free, and another process may take the name
while this one still runs. So each write transaction first takes a shared barrier lock and
checks that the name's lock is still held by this process's lock session. If PostgreSQL
restarted (every session ended) and the name is free, the writer takes it back; if the lock
session alone ended (killed), the writer stops: another process may have taken the name and
closed this one's requests meanwhile. A new holder takes
the barrier exclusively once (waiting for the old holder's write transactions in flight)
before it reads or closes anything: every batch the old holder committed is seen, and every
later one sees the name taken and is rolled back."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sys
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from engine.store.lock import StoreLockedError

# The lock's first key: tokenflow's namespace, so no other application's lock collides.
_NAMESPACE = int.from_bytes(b"tflw", "big") & 0x7FFFFFFF
_BARRIER = _NAMESPACE + 1  # the write barrier's first key, beside the name's lock
_APPLICATION_NAME_MAX = 63  # PostgreSQL truncates longer names
_KEYS = "CAST(:ns AS int4), CAST(:key AS int4)"
_HOLDER = ("SELECT a.application_name, a.client_addr, a.pid FROM pg_locks l "
           "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
           "AND l.classid = CAST(:ns AS oid) AND l.objid = CAST(:key AS oid) "
           "AND l.objsubid = 2 AND l.granted")
_HELD_BY = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
            "AND classid = CAST(:ns AS oid) AND objid = CAST(:key AS oid) AND objsubid = 2 "
            "AND granted AND pid = :pid")


class ServerNameLost(StoreLockedError):
    """Another process holds this server name now: this one must stop writing as it."""


def lock_key(server: str) -> int:
    return int.from_bytes(hashlib.sha256(server.encode()).digest()[:4], "big") & 0x7FFFFFFF


def holder_description() -> str:
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    command = " ".join([program, *sys.argv[1:2]])
    return f"pid {os.getpid()} on {socket.gethostname()}: {command}"[:_APPLICATION_NAME_MAX]


@dataclass
class ServerLock:
    server: str
    connection: Connection | None
    backend_pid: int = 0  # the lock session's PostgreSQL backend
    engine: Engine | None = None
    location: str = ""
    started: object = None  # pg_postmaster_start_time() when the lock was taken

    @classmethod
    def acquire(cls, engine: Engine, server: str, location: str) -> ServerLock:
        connection = engine.connect()
        try:
            pid = _take(connection, server, location)
            # wait out the write transactions a previous holder may still have in flight
            connection.execute(text(f"SELECT pg_advisory_lock({_KEYS})"),
                               {"ns": _BARRIER, "key": lock_key(server)})
            connection.execute(text(f"SELECT pg_advisory_unlock({_KEYS})"),
                               {"ns": _BARRIER, "key": lock_key(server)})
            connection.commit()  # the locks are the session's; no transaction stays open
        except BaseException:
            connection.close()
            raise
        return cls(server, connection, pid, engine, location, _postmaster_start(connection))

    def check(self, connection: Connection) -> bool:
        """In a write transaction (`connection`'s): True if this process still holds the name;
        False if it had lost it and took it back (nobody held it; the caller retries the
        transaction); ServerNameLost if another process holds it."""
        keys = {"ns": _BARRIER, "key": lock_key(self.server)}
        connection.execute(text(f"SELECT pg_advisory_xact_lock_shared({_KEYS})"), keys)
        held = connection.execute(text(_HELD_BY), {"ns": _NAMESPACE,
                                                   "key": lock_key(self.server),
                                                   "pid": self.backend_pid}).scalar()
        if held:
            return True
        if _postmaster_start(connection) == self.started:
            # the session alone ended (killed) while PostgreSQL ran on: another process may
            # have taken the name and closed this one's requests meanwhile
            raise ServerNameLost(
                f"the lock on the server name {self.server!r} in {self.location} was lost "
                "(its connection was ended while PostgreSQL kept running); another process "
                "may write as this name now, so this process stopped writing as it. Nothing "
                "after this point was recorded here: restart it")
        self._retake()
        return False

    def _retake(self) -> None:
        """PostgreSQL restarted, ending every session and lock: take the name again if it is
        free, else ServerNameLost."""
        assert self.engine is not None
        if self.connection is not None:
            self.connection.invalidate()
            self.connection.close()
            self.connection = None
        connection = self.engine.connect()
        try:
            self.backend_pid = _take(connection, self.server, self.location, lost=True)
            self.started = _postmaster_start(connection)
            connection.commit()
        except BaseException:
            connection.close()
            raise
        self.connection = connection

    def release(self) -> None:
        if self.connection is None:
            return
        try:
            with contextlib.suppress(DBAPIError):  # a session already gone took its lock along
                self.connection.execute(text(f"SELECT pg_advisory_unlock({_KEYS})"),
                                        {"ns": _NAMESPACE, "key": lock_key(self.server)})
                self.connection.commit()
        finally:
            self.connection.invalidate()  # never back to the pool with its name set
            self.connection.close()
            self.connection = None


def _take(connection: Connection, server: str, location: str, lost: bool = False) -> int:
    """Take the name's lock on `connection`'s session: its backend pid, else StoreLockedError
    (ServerNameLost when `lost`: this process held it until its session ended)."""
    connection.execute(text("SELECT set_config('application_name', :name, false)"),
                       {"name": holder_description()})
    taken = connection.execute(text(f"SELECT pg_try_advisory_lock({_KEYS})"),
                               {"ns": _NAMESPACE, "key": lock_key(server)}).scalar()
    if not taken:
        holder = _holder(connection, server)
        if lost:
            raise ServerNameLost(
                f"the server name {server!r} was taken over in {location} ({holder}) after "
                "this process's lock session ended; this process stopped writing as it. "
                "Nothing after this point was recorded here: stop one of the two, or give "
                "each its own --server-name")
        raise StoreLockedError(
            f"the server name {server!r} already writes into {location} ({holder}); "
            "one process writes as a server name at a time: stop it, or pass "
            "--server-name NAME to write as another server")
    return int(connection.execute(text("SELECT pg_backend_pid()")).scalar() or 0)


def _postmaster_start(connection: Connection) -> object:
    return connection.execute(text("SELECT pg_postmaster_start_time()")).scalar()


def _holder(connection: Connection, server: str) -> str:
    row = connection.execute(text(_HOLDER), {"ns": _NAMESPACE, "key": lock_key(server)}).first()
    if row is None:
        return "holder unknown"
    name, address, pid = row
    where = f", from {address}" if address is not None else ""
    return f"{name or 'a client'}{where}, backend pid {pid}"
