"""One writer per store: an exclusive lock on `<db>.lock` held by whoever journals.

Two processes appending to the same journal rows corrupt it (issue 15, finding 3), so the
writer takes `fcntl.flock` on a file beside the database and writes its pid and command
line there for the next one to name. The kernel drops the lock when the holder dies, so a
SIGKILLed run never leaves a stale lock. Readers never take it.
"""

from __future__ import annotations

import fcntl
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError


class StoreLockedError(EngineError):
    """Another process journals to this store; the message names it."""


def lock_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".lock")


@dataclass
class WriterLock:
    path: Path
    fd: int

    @classmethod
    def acquire(cls, db_path: Path) -> WriterLock:
        """Take the store's writer lock at once, or raise StoreLockedError naming the holder."""
        path = lock_path(db_path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"the store {db_path} is in use by another writer ({holder}); one process "
                "journals to a store at a time: stop it, or pass --db PATH to use another "
                "file") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        command = " ".join(sys.argv) or sys.executable
        os.pwrite(fd, f"pid {os.getpid()}: {command}\n".encode("utf-8", "replace"), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)  # no stale holder named once released
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1
