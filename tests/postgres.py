"""A throwaway PostgreSQL cluster for the tests: initdb in a temporary directory, started
once per session on a free port with its socket beside its data, stopped at the end.

PostgreSQL refuses to run as root, so where the tests run as root the cluster belongs to
the unprivileged `nobody` (`runuser`). Tests get a fresh database each (`create_database`),
at the schema's head; the store's migration test still takes it down to empty and back.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

HOW_TO_GET = ("PostgreSQL 15 not found: install it (apt-get install postgresql-15) or set "
              "TOKENFLOW_PG_BINDIR to its bin directory")
_BINDIRS = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin",
            "/usr/lib/postgresql/17/bin")
_RUN_AS = "nobody"


def postgres_bindir() -> Path | None:
    candidates = [os.environ.get("TOKENFLOW_PG_BINDIR", ""), *_BINDIRS]
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").is_file():
            return Path(candidate)
    return None


def unavailable() -> str | None:
    """Why PostgreSQL tests cannot run here; None when they can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed: pip install -e '.[dev]'"
    return None if postgres_bindir() is not None else HOW_TO_GET


TEMPLATE = "tokenflow_head"


@dataclass
class Cluster:
    port: int
    root: Path
    _names: Iterator[int]
    _template_ready: bool = False
    _control: tuple[str, ...] = ()  # pg_ctl -D DATA -o OPTIONS -l LOG, as its owner

    def stop(self) -> None:
        """Stop the server as a restart does: every session, and its locks, ends."""
        subprocess.run([*self._control, "-m", "fast", "-w", "stop"], check=True,
                       capture_output=True, cwd=self.root)

    def start(self) -> None:
        subprocess.run([*self._control, "-w", "start"], check=True, capture_output=True,
                       cwd=self.root)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new database holding the store's schema at head; its URL. Copied from a
        template migrated once per session: migrating each one cost half a second."""
        import psycopg

        from engine.store import open_database

        name = f"t{next(self._names)}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres",
                             dbname="postgres", autocommit=True) as connection:
            if not self._template_ready:
                connection.execute(f"CREATE DATABASE {TEMPLATE}")
                open_database(self.url(TEMPLATE)).close()
                self._template_ready = True
            connection.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
        return self.url(name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _as_owner(command: list[str]) -> list[str]:
    return ["runuser", "-u", _RUN_AS, "--", *command] if os.geteuid() == 0 else command


@contextmanager
def cluster() -> Iterator[Cluster]:
    bindir = postgres_bindir()
    assert bindir is not None
    root = Path(tempfile.mkdtemp(prefix="tokenflow-pg-"))
    data, port = root / "data", free_port()
    if os.geteuid() == 0:
        import pwd

        owner = pwd.getpwnam(_RUN_AS)
        os.chown(root, owner.pw_uid, owner.pw_gid)
    try:
        subprocess.run(_as_owner([str(bindir / "initdb"), "-D", str(data), "-U", "postgres",
                                  "--auth=trust", "-E", "UTF8", "--no-sync"]),
                       check=True, capture_output=True, cwd=root)
        # fsync off: a test cluster is thrown away; a crash of the tests' server never is
        options = (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        control = tuple(_as_owner([str(bindir / "pg_ctl"), "-D", str(data), "-o", options,
                                   "-l", str(root / "log")]))
        subprocess.run([*control, "-w", "start"], check=True, capture_output=True, cwd=root)
        try:
            yield Cluster(port, root, itertools.count(), _control=control)
        finally:
            subprocess.run(_as_owner([str(bindir / "pg_ctl"), "-D", str(data), "-m",
                                      "immediate", "stop"]), capture_output=True, cwd=root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def skip_or_fail(reason: str) -> None:
    """Skip with how to get PostgreSQL, except on CI, where its tests must run."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL tests cannot run on CI: {reason}")
    pytest.skip(reason)
