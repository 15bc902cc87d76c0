"""The console's default source: the embedded engine in a child process, reached over a pipe."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path

import pytest

from console.sources.base import SourceError
from console.sources.process import ProcessSource
from console.tui.app import TokenflowApp
from console.tui.widgets.header import EngineHeader
from engine.config import ConfigError
from engine.errors import ModelLoadError
from engine.store import calibration_history, default_db_path, open_database
from engine.store.calibration import REUSED
from tests.console.conftest import ENGINE_PROCESSES, FAST_POLL_S, until

pytestmark = pytest.mark.slow  # starts the console's engine process


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory,
           calibrated_template: Path) -> Iterator[ProcessSource]:
    db = tmp_path_factory.mktemp("process") / "p.db"
    shutil.copyfile(calibrated_template, db)  # no first calibration beside the calls
    source = ProcessSource.start(ENGINE_PROCESSES, model="synthetic:tiny", device="cpu",
                                 workload="chat", db=db, num_requests=4, rate=float("inf"),
                                 repeat=False)
    yield source
    source.close()


def test_snapshots_come_from_the_child_engine(source: ProcessSource) -> None:
    snapshot = source.snapshot()
    assert snapshot.model == "synthetic:tiny"
    assert source.name == "embedded synthetic:tiny on cpu"


def test_a_bad_value_raises_the_engines_error_naming_the_field(source: ProcessSource) -> None:
    before = source.snapshot().config["max_num_batched_tokens"]
    with pytest.raises(ConfigError) as caught:
        source.update_config(max_num_batched_tokens=-5)
    assert caught.value.field == "max_num_batched_tokens"
    assert source.snapshot().config["max_num_batched_tokens"] == before


def test_a_good_value_applies_and_is_stored(source: ProcessSource) -> None:
    applied = source.update_config(slow_query_threshold=2.5)
    assert applied["slow_query_threshold"] == 2.5
    changes = source.config_changes()
    assert (changes[0].field, changes[0].new, changes[0].source) == ("slow_query_threshold", 2.5,
                                                                    "console")


def test_calls_from_many_threads_get_their_own_answers(source: ProcessSource) -> None:
    results: dict[int, object] = {}

    def ask(i: int) -> None:
        results[i] = source.slow_queries() if i % 2 else source.snapshot().model

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[i] == "synthetic:tiny" for i in range(0, 8, 2))
    assert all(isinstance(results[i], list) for i in range(1, 8, 2))


def test_a_missing_slow_query_is_a_source_error(source: ProcessSource) -> None:
    with pytest.raises(SourceError, match="no slow query with id 999999"):
        source.slow_query(999999)


def test_pause_and_resume_reach_the_engine(source: ProcessSource) -> None:
    source.pause()
    assert source.snapshot().paused
    source.resume()
    assert not source.snapshot().paused


def test_a_missing_model_path_fails_start_with_the_engines_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model"):
        ProcessSource.start(ENGINE_PROCESSES, model=str(tmp_path / "no-such-model"),
                            device="cpu", db=tmp_path / "m.db")


def test_a_forked_engine_runs_in_its_launchers_environment_and_directory(
        calibrated_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forkserver keeps the environment and directory it started in; a child it forks
    takes its launcher's, as a spawned one does: a relative --db lands here, and the default
    store it reuses a calibration from is this environment's."""
    forkserver.ensure_running()  # in the environment and directory before the changes below
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    default_db_path().parent.mkdir(parents=True)
    shutil.copyfile(calibrated_template, default_db_path())
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    source = ProcessSource.start(ENGINE_PROCESSES, model="synthetic:tiny", device="cpu",
                                 workload="chat", db="relative.db", num_requests=2,
                                 repeat=False)
    try:
        assert source.snapshot().calibration_reused
    finally:
        source.close()
    database = open_database(tmp_path / "here" / "relative.db")
    try:
        with database.session() as session:
            (reused,) = calibration_history(session, model="synthetic:tiny", device="cpu")
    finally:
        database.close()
    assert reused.reason.endswith(f" of {default_db_path()}{REUSED}"), reused.reason


def test_after_close_a_call_is_a_clear_error(calibrated_db: Path) -> None:
    source = ProcessSource.start(ENGINE_PROCESSES, model="synthetic:tiny", device="cpu",
                                 workload="chat", db=calibrated_db, num_requests=2,
                                 repeat=False)
    source.close()
    with pytest.raises(SourceError, match="closed"):
        source.snapshot()


@pytest.mark.anyio
async def test_a_killed_engine_process_is_a_clear_error_the_header_keeps_showing(
        calibrated_db: Path) -> None:
    """Not a hang: each call says the process exited and how; the header says so too, after
    its toast has gone, on every screen. Spawned, as the console spawns its engine: the exit
    code comes from that child's own reaping."""
    source = ProcessSource.start(model="synthetic:tiny", device="cpu", workload="chat",
                                 db=calibrated_db, num_requests=2, repeat=False)
    app = TokenflowApp(source, interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        header = app.screen.query_one(EngineHeader)
        os.kill(source._process.pid, signal.SIGKILL)
        source._process.join(10)
        with pytest.raises(SourceError, match=r"engine process has exited \(exit code -9\)"):
            source.snapshot()
        await until(pilot, lambda: "SOURCE FAILED" in str(header.render()), "the failure shown")
        shown = str(header.render())
        assert "SOURCE FAILED" in shown and "engine process has exited" in shown
        await pilot.press("2")  # another screen shows it too
        await pilot.pause()
        assert "SOURCE FAILED" in str(app.screen.query_one(EngineHeader).render())


def test_calls_failing_at_once_on_many_threads_all_say_how_the_process_ended() -> None:
    """The pipe's reader and the callers may find the process gone together, each outside the
    send lock: each one's error names the exit code, though only one of them reaps the child."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=signal.pause, daemon=True)
    process.start()
    child.close()
    source = ProcessSource(process, parent)
    os.kill(process.pid, signal.SIGKILL)
    ready = threading.Barrier(16)
    errors: list[str] = []

    def call() -> None:
        ready.wait()
        errors.append(str(source._gone()))

    threads = [threading.Thread(target=call) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    source.close()
    assert len(errors) == 16 and all("(exit code -9)" in e for e in errors), errors


def test_the_arrival_rate_call_crosses_the_pipe(source: ProcessSource) -> None:
    assert source.snapshot().workload_rate is None  # sent all at once: no rate to turn
    with pytest.raises(SourceError, match="no workload with a rate is playing"):
        source.set_arrival_rate(2.0)
