"""Shared fixtures: seeded randomness, tiny Hugging Face reference models, and a throwaway
PostgreSQL cluster for the store's tests on both databases."""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine import Engine
from engine.config import EngineConfig
from engine.serve.loop import EngineLoop
from tests.postgres import Cluster, cluster, skip_or_fail, unavailable

SOAK_WHY = "a soak: CI runs it (CI=true), as do `--soak` and naming its file"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run the tests marked soak (CI does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Soaks run in CI, with --soak, or when their file is named; elsewhere each is skipped
    with the reason, so the loop before a commit stays short and CI still runs everything."""
    if config.getoption("--soak") or os.environ.get("CI") == "true":
        return
    named = {Path(arg.split("::", 1)[0]).resolve() for arg in config.args}
    for item in items:
        if item.get_closest_marker("soak") is not None and item.path not in named:
            item.add_marker(pytest.mark.skip(reason=SOAK_WHY))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The worker's heap once every module is imported (torch, transformers, textual, the
    tree) is kept out of later collections, as serve keeps its start-up heap: each gen-2
    collection a test triggers then walks only what tests made."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _isolated_data_dir(tmp_path_factory: pytest.TempPathFactory,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands that default to the user's data directory write into a temp one instead."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    """One throwaway PostgreSQL cluster for the whole session (see tests/postgres.py)."""
    reason = unavailable()
    if reason is not None:
        skip_or_fail(reason)
    with cluster() as started:
        yield started


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store of each kind: a SQLite file, then a new PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return request.getfixturevalue("postgres").create_database()


@pytest.fixture(autouse=True, scope="session")
def _quiet_host() -> Iterator[None]:
    """Engines read a quiet host (module-scoped ones too): what a test asserts never hangs on
    its neighbours' load. Tests of host sensing build their HostSensor with their readings."""
    from engine.ops import equipped
    from engine.ops.host import HostCounters, HostSensor, NvmlProcesses

    def quiet(clock: Callable[[], float], gpu: NvmlProcesses | None = None) -> HostSensor:
        return HostSensor(clock, read=lambda: HostCounters(0.0, 0.0, 0.0, 0.0, cpus=1),
                          gpu=gpu)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(equipped, "HostSensor", quiet)
        yield


@pytest.fixture(autouse=True, scope="session")
def _small_host_pools() -> Iterator[None]:
    """An engine built here without a KV size gets 32 MiB, not the 256 MiB a user's CPU
    engine gets: every page of a pool is faulted in as it is made, hundreds of engines are
    made, and no test's requests need more. Tests of the pool's sizing give theirs."""
    from engine.core import model_runner

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "CPU_KV_BYTES_DEFAULT", 32 * 2**20)
        yield


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    """A started engine loop on synthetic:tiny, shared by a module's tests; a module that
    needs another configuration defines its own `loop`."""
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    started = EngineLoop(engine).start()
    yield started
    started.stop()
