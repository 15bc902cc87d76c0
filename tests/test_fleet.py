"""Fleets: servers polled concurrently, down and back by themselves, and the overview screen."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from console.sources import HttpSource, SglangMetricsSource, VllmMetricsSource, open_http_source
from console.sources.fleet import FleetSource
from console.tui.app import TokenflowApp
from console.tui.screens.fleet import FleetScreen
from console.tui.screens.live import LiveScreen
from console.tui.widgets.fleet_table import FleetTable
from engine import Engine, EngineConfig
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.thread import ServerThread
from tests.console.conftest import FAST_POLL_S, until, workers_done

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"


def metrics_server(text: str) -> ServerThread:
    async def metrics(_request: Request) -> PlainTextResponse:
        return PlainTextResponse(text)

    return ServerThread(Starlette(routes=[Route("/metrics", metrics)]))


@pytest.fixture(scope="module")
def vllm_files() -> Iterator[ServerThread]:
    """Recorded vLLM-CPU metrics, served by a small local file server."""
    with metrics_server((DATA / "vllm_capture" / "metrics_2.txt").read_text()) as running:
        yield running


def start_serve(port: int = 0) -> tuple[subprocess.Popen[str], str]:
    """`tokenflow serve` on synthetic:tiny; returns once it has printed its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "console.cli.main", "serve", "--model", "synthetic:tiny",
         "--device", "cpu", "--port", str(port), "--no-db", "--public-stats"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:  # the banner comes once the socket listens
        found = re.search(r"(http://[\d.]+:\d+),", line)
        if found:
            return process, found.group(1)
    raise AssertionError(f"tokenflow serve exited with {process.wait()} before listening")


def stop(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait()


def test_a_killed_server_goes_down_and_comes_back(vllm_files: ServerThread) -> None:
    first, first_url = start_serve()
    second, second_url = start_serve()
    fleet = open_http_source([first_url, second_url, f"vllm+{vllm_files.url}"])
    assert isinstance(fleet, FleetSource)
    try:
        assert fleet.wait_for(lambda: all(s.up for s in fleet.states), timeout=30)
        rows = fleet.rows()
        assert len(rows) == 3 and {r.health for r in rows} == {"up"}
        assert {r.model for r in rows} == {"synthetic:tiny", "tiny-llama"}
        stop(first)
        killed_at = time.time()
        assert fleet.wait_for(lambda: fleet.states[0].error != "", timeout=5)
        down = next(r for r in fleet.rows() if r.index == 0)
        assert down.health == "down" and down.last_seen is not None
        assert down.last_seen <= killed_at and fleet.rows()[0] == down  # worst first
        assert fleet.states[1].up and fleet.states[2].up  # the others carry on
        port = int(first_url.rsplit(":", 1)[1])
        first, _ = start_serve(port)
        assert fleet.wait_for(lambda: fleet.states[0].up, timeout=30)
        assert {r.health for r in fleet.rows()} == {"up"}
    finally:
        fleet.close()
        stop(first)
        stop(second)


def test_a_slow_server_does_not_hold_the_others_back(vllm_files: ServerThread) -> None:
    released = asyncio.Event()

    async def stuck(_request: Request) -> PlainTextResponse:
        await released.wait()
        return PlainTextResponse("")

    with ServerThread(Starlette(routes=[Route("/metrics", stuck)])) as slow_server:
        slow = VllmMetricsSource(slow_server.url)
        slow.remote.timeout = 60.0  # it would rather wait than fail: it must not matter
        fast = VllmMetricsSource(vllm_files.url)
        fleet = FleetSource([slow, fast], interval=FAST_POLL_S)
        try:
            assert fleet.wait_for(lambda: fleet.states[1].polls >= 5, timeout=30)
            assert fleet.states[0].polls == 0 and fleet.rows()[0].health == "starting"
        finally:
            slow_server.server.should_exit = True  # ends the stuck request with the server
            fleet.close()


@pytest.fixture(scope="module")
def tokenflow_server() -> Iterator[ServerThread]:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    loop = EngineLoop(engine).start()
    with ServerThread(create_app(loop, admin_token="", public_stats=True)) as running:
        yield running
    loop.stop()


@pytest.mark.anyio
async def test_the_fleet_screen_lists_servers_worst_first_and_enter_opens_one(
        tokenflow_server: ServerThread, vllm_files: ServerThread) -> None:
    with metrics_server((DATA / "sglang_metrics.txt").read_text()) as sglang:
        members = [HttpSource(tokenflow_server.url), VllmMetricsSource(vllm_files.url),
                   SglangMetricsSource(sglang.url), HttpSource("http://127.0.0.1:9")]
        fleet = FleetSource(members, interval=FAST_POLL_S)
        assert fleet.wait_for(lambda: all(s.polls for s in fleet.states), timeout=30)
        app = TokenflowApp(fleet, interval=FAST_POLL_S)
        async with app.run_test(size=(160, 40)) as pilot:
            await pilot.press("0")
            await workers_done(pilot)
            assert isinstance(app.screen, FleetScreen)
            table = app.screen.query_one(FleetTable)
            await until(pilot, lambda: table.table.row_count == 4, "four fleet rows")
            first = table.table.get_row_at(0)
            assert str(first[0]) == "4" and str(first[1]).startswith("down")  # the dead one on top
            assert "1 down" in str(table.border_subtitle)
            await pilot.press("down", "enter")
            await until(pilot, lambda: isinstance(app.screen, LiveScreen), "the live screen")
            opened = int(str(table.table.get_row_at(1)[0])) - 1
            assert fleet.selected == opened
            app.collector.stop()
            await workers_done(pilot)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
