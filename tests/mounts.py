"""A real small or read-only filesystem for the store's full-disk and read-only tests: a
tmpfs mounted for the test. Mounting needs privileges; without them those tests skip."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@contextmanager
def tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """`directory` as a tmpfs of `size` (mount's units: 8k, 1m) for the `with` block."""
    directory.mkdir(exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory))
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True)


def remount(directory: Path, options: str) -> None:
    """Change a tmpfs from `tmpfs()` in place: `ro`, `rw`, `size=1m`."""
    _mount("-o", f"remount,{options}", str(directory))
