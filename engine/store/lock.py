"""One writer per SQLite store: an exclusive `flock` on `<db>.lock` that dies with its holder."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError


class StoreLockedError(EngineError):
    """Another process journals to this store; the message names it."""


class LockFileError(EngineError):
    """The lock path is a symlink, a link, another user's file or no file: not ours to write."""


def lock_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".lock")


@dataclass
class WriterLock:
    path: Path
    fd: int

    @classmethod
    def acquire(cls, db_path: Path) -> WriterLock:
        """Take the writer lock at once, or raise StoreLockedError naming the holder."""
        path = lock_path(db_path)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _not_ours(path, db_path, "is a symbolic link") from None
            raise
        try:
            problem = _foreign(os.fstat(fd))
            if problem is not None:
                raise _not_ours(path, db_path, problem)
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
        os.ftruncate(fd, 0)  # ours: a plain file with one link, checked above
        command = " ".join(sys.argv) or sys.executable
        os.pwrite(fd, f"pid {os.getpid()}: {command}\n".encode("utf-8", "replace"), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1


def _foreign(info: os.stat_result) -> str | None:
    """Why the opened lock path is not ours to truncate, or None when it is."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_nlink != 1:
        return f"has {info.st_nlink} hard links (another file's contents)"
    if info.st_uid != os.geteuid():
        return f"belongs to another user (uid {info.st_uid})"
    return None


def _not_ours(path: Path, db_path: Path, problem: str) -> LockFileError:
    return LockFileError(
        f"the lock file {path} of the store {db_path} {problem}; it was left untouched. "
        f"Remove it if it is stale (rm {path}), or pass --db PATH to use another file")
