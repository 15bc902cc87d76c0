"""One writer per server name in a shared PostgreSQL store: a session advisory lock."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, text

from engine.store.lock import StoreLockedError

# The lock's first key: tokenflow's namespace, so no other application's lock collides.
_NAMESPACE = int.from_bytes(b"tflw", "big") & 0x7FFFFFFF
_APPLICATION_NAME_MAX = 63  # PostgreSQL truncates longer names
_KEYS = "CAST(:ns AS int4), CAST(:key AS int4)"
_HOLDER = ("SELECT a.application_name, a.client_addr, a.pid FROM pg_locks l "
           "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
           "AND l.classid = CAST(:ns AS oid) AND l.objid = CAST(:key AS oid) "
           "AND l.objsubid = 2 AND l.granted")


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

    @classmethod
    def acquire(cls, engine: Engine, server: str, location: str) -> ServerLock:
        connection = engine.connect()
        try:
            connection.execute(text("SELECT set_config('application_name', :name, false)"),
                               {"name": holder_description()})
            taken = connection.execute(text(f"SELECT pg_try_advisory_lock({_KEYS})"),
                                       {"ns": _NAMESPACE, "key": lock_key(server)}).scalar()
            if not taken:
                holder = _holder(connection, server)
                raise StoreLockedError(
                    f"the server name {server!r} already writes into {location} ({holder}); "
                    "one process writes as a server name at a time: stop it, or pass "
                    "--server-name NAME to write as another server")
            connection.commit()  # the lock is the session's; no transaction stays open
        except BaseException:
            connection.close()
            raise
        return cls(server, connection)

    def release(self) -> None:
        if self.connection is not None:
            try:
                self.connection.execute(text(f"SELECT pg_advisory_unlock({_KEYS})"),
                                        {"ns": _NAMESPACE, "key": lock_key(self.server)})
                self.connection.commit()
            finally:
                self.connection.invalidate()  # never back to the pool with its name set
                self.connection.close()
                self.connection = None


def _holder(connection: Connection, server: str) -> str:
    row = connection.execute(text(_HOLDER), {"ns": _NAMESPACE, "key": lock_key(server)}).first()
    if row is None:
        return "holder unknown"
    name, address, pid = row
    where = f", from {address}" if address is not None else ""
    return f"{name or 'a client'}{where}, backend pid {pid}"
