"""Files a command writes (--output, the console's --record): never through a symlink, never
over a file unasked."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from console.errors import UserError


def check_output(path: Path, *, may_exist: bool, keep_hint: str, flag: str = "--output") -> None:
    """Refuse, before any work, an output file (`flag`'s) that is a symlink (it would write
    where it points), or that exists unless `may_exist` (`keep_hint` says which flag allows
    it)."""
    if path.is_symlink():
        raise UserError(f"{flag} {path} is a symlink; name the file itself")
    if not may_exist and path.exists():
        raise UserError(f"{flag} {path} exists; choose another {flag}, or {keep_hint}")
    if not path.parent.is_dir():  # found now, not once the work is done or the model loaded
        raise UserError(f"{flag} {path}: no directory {path.parent}; create it first")


def open_output(path: Path, flags: int) -> int:
    """A descriptor of the regular file `path`, opened with `flags` | O_CREAT | O_NOFOLLOW."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UserError(f"cannot open --output {path}: {exc.strerror}; choose "
                        "another --output") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device
        os.close(fd)
        raise UserError(f"--output {path} is not a regular file; choose another --output")
    return fd
