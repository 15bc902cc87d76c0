"""`tokenflow serve` as a subprocess for tests: started on synthetic:tiny, stopped by SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def serve_on(db: Path, *flags: str) -> subprocess.Popen[str]:
    """`tokenflow serve` on synthetic:tiny with the store `db`; its banner is its first line."""
    return subprocess.Popen(
        [sys.executable, "-m", "console.cli.main", "serve", "--model", "synthetic:tiny",
         "--device", "cpu", "--dtype", "float32", "--port", "0", "--db", str(db), *flags],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def killed_if_left(server: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """`server`, killed on the way out if the test left it running (a failed assertion)."""
    try:
        yield server
    finally:
        if server.poll() is None:
            server.kill()


def stopped(server: subprocess.Popen[str]) -> str:
    """SIGTERM `server`, wait for it, and return its stderr; it must exit 0."""
    server.send_signal(signal.SIGTERM)
    _out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    return err
