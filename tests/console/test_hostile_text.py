"""Text from outside is shown as text: ids, tenants and errors holding markup or terminal
escapes reach the screen as their escapes, through a replayed and through a traced source."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from rich.console import Console
from textual.widgets import DataTable, Static

from console.sources.replay import ReplaySource
from console.sources.vllm import VllmMetricsSource
from console.tui.app import TokenflowApp
from console.tui.screens.request_detail import RequestDetail
from console.tui.screens.slow_queries import SlowQueryDetail
from console.tui.text import escaped, plain
from console.tui.widgets.chunk_queue import ChunkQueue
from console.tui.widgets.header import EngineHeader
from console.tui.widgets.requests_table import RequestsTable
from engine.serve.otlp import TraceCollector
from tests.console.conftest import REPLAY_POLL_S, SESSION, replayed, until, workers_done

MARKUP = "[/]"
TITLE = "\x1b]0;owned\x07"
CLEAR = "\x1b[2J"
CAPTURE = Path(__file__).parents[1] / "data" / "vllm_capture"

pytestmark = pytest.mark.anyio


def hostile_recording(tmp_path: Path) -> Path:
    """The recorded session, its requests and slow queries named by an attacker."""
    hostile = [MARKUP, TITLE, CLEAR]
    lines = []
    for line in SESSION.read_text().splitlines():
        record = json.loads(line)
        data = record["data"]
        if record["kind"] == "snapshot":
            for index, request in enumerate(data["requests"][:3]):
                request["id"] = hostile[index]
                request["tenant"] = f"[bold]{CLEAR}"
                if index == 1:  # the chunk queue lists prefilling requests by id
                    request["state"] = "PREFILL_CHUNKING"
            data["mode"] = f"NORMAL{TITLE}"
            # a failure's reason, from outside, in the calibration state the panes say
            data["calibration"] = f"uncalibrated: the first calibration failed ({MARKUP}{TITLE})"
            data["prefix_cache_hit_rate"] = 1.7e308  # finite, absurd: unknown, never drawn
            data["ttft_ms"] = {"p50": -1.7e308, "p90": None, "p99": 1.7e308}
        elif record["kind"] == "slow_query":
            data["request_id"], data["tenant"], data["tag"] = TITLE, MARKUP, CLEAR
            # a verdict's two lines, the first carrying a failure reason from outside
            data["verdict"] = f"prefill took 1.2 s: then failed: {TITLE}\nbudget_score 1.50"
            data["server"] = TITLE
        lines.append(json.dumps(record))
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def rendered(renderable: object) -> str:
    printer = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    printer.print(renderable)
    return printer.export_text()


async def test_the_helper_escapes_controls_and_never_parses_markup() -> None:
    assert escaped(TITLE) == "\\x1b]0;owned\\x07" and escaped(CLEAR) == "\\x1b[2J"
    assert escaped("a\u202eb\u2028c\td\x9b") == "a\\u202eb\\u2028c\\x09d\\x9b"
    assert escaped("vllm-é 中文 x") == "vllm-é 中文 x"
    assert plain(MARKUP).plain == MARKUP and plain(MARKUP).spans == []
    assert "\x1b" not in rendered(plain(TITLE + CLEAR))


@pytest.mark.slow  # replays a recording in the console
async def test_hostile_ids_in_a_recording_show_as_text(tmp_path: Path) -> None:
    app = TokenflowApp(ReplaySource(hostile_recording(tmp_path), speed=0),
                       interval=REPLAY_POLL_S)
    async with app.run_test(size=(140, 40)) as pilot:
        await replayed(pilot)
        table = app.screen.query_one(RequestsTable).table
        cells = [cell for row in range(table.row_count) for cell in table.get_row_at(row)]
        shown = [cell.plain if hasattr(cell, "plain") else cell for cell in cells]
        assert any(MARKUP in text for text in shown)
        assert any("\\x1b]0;" in text for text in shown)
        assert all("\x1b" not in text and "\x07" not in text for text in shown)
        header = rendered(app.screen.query_one(EngineHeader).content)
        assert "NORMAL\\x1b]0;owned\\x07" in header and "\x1b" not in header
        assert "C* uncalibrated" in header
        subtitle = app.screen.query_one(RequestsTable).border_subtitle
        assert subtitle is not None and "\x1b" not in str(subtitle)
        assert "failed ([/]\\x1b]0;owned\\x07)" in str(subtitle).replace("\\[", "[")

        view = next(r for r in app.latest.requests if r.id == TITLE)
        await app.push_screen(RequestDetail(view))
        await pilot.pause()
        assert "\\x1b]0;owned\\x07" in str(app.screen.query_one("#detail").border_title)
        detail = rendered(app.screen.query(Static).first().content)
        assert "[bold]\\x1b[2J" in detail and "\x1b" not in detail
        app.pop_screen()

        record = app.source.slow_queries()[0]
        await app.push_screen(SlowQueryDetail(record))
        await pilot.pause()
        summary = rendered(app.screen.query(Static).first().content)
        assert "request \\x1b]0;owned\\x07" in summary and "tenant [/]" in summary
        # the verdict's lines (the felt part, then the budget_score), each escaped alone
        verdict = rendered(app.screen.query_one("#detail-verdict", Static).content)
        assert "failed: \\x1b]0;owned\\x07\n        budget_score 1.50" in verdict
        assert "\x1b" not in verdict
        app.pop_screen()

        app.notify(escaped(f"source failed: {MARKUP}{TITLE}"), markup=False)  # as the app does
        await pilot.pause()
        assert app.is_running


async def test_a_traced_span_named_with_markup_does_not_end_the_console() -> None:
    span = Span(name="llm_request", start_time_unix_nano=int(1.78e18), attributes=[
        KeyValue(key="gen_ai.request.id", value=AnyValue(string_value=MARKUP)),
        KeyValue(key="gen_ai.usage.prompt_tokens", value=AnyValue(int_value=12))])
    message = ExportTraceServiceRequest()
    resource = message.resource_spans.add()
    resource.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="[b]vllm")))
    resource.scope_spans.add().spans.append(span)
    collector = TraceCollector(wall_clock=lambda: 1.78e9)
    assert collector.ingest(message.SerializeToString()).requests[0].request_id == MARKUP
    text = (CAPTURE / "metrics_2.txt").read_text()
    source = VllmMetricsSource("http://vllm.test", traces=collector, transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text=text)))
    app = TokenflowApp(source, interval=REPLAY_POLL_S)
    async with app.run_test(size=(140, 40)) as pilot:
        await until(pilot, lambda: app.screen.query(RequestsTable)
                    and app.screen.query_one(RequestsTable).table.row_count == 1, "the row")
        row = app.screen.query_one(RequestsTable).table.get_row_at(0)
        assert row[0].plain == MARKUP and row[1].plain == "[b]vllm"
        assert app.is_running
    source.close()


async def test_every_screen_shows_hostile_values_as_text(tmp_path: Path) -> None:
    app = TokenflowApp(ReplaySource(hostile_recording(tmp_path), speed=0),
                       interval=REPLAY_POLL_S)
    async with app.run_test(size=(160, 50)) as pilot:
        await replayed(pilot)
        assert app.latest.prefix_cache_hit_rate is None and app.latest.ttft_ms.p50 is None
        for key in ("1", "2", "3", "4", "5", "0", "1"):
            await pilot.press(key)
            await workers_done(pilot)
            screen = app.export_screenshot()
            assert "\x1b" not in screen and "\x07" not in screen, key
            assert app.is_running, key
        queue = rendered(app.screen.query_one(ChunkQueue).render())
        assert "\\x1b" in queue and "\x1b" not in queue
        await pilot.press("3")
        await workers_done(pilot)
        table = app.screen.query_one(DataTable)
        cells = [cell for row in range(table.row_count) for cell in table.get_row_at(row)]
        shown = [cell.plain if hasattr(cell, "plain") else str(cell) for cell in cells]
        assert any("\\x1b]0;owned" in text for text in shown)
        assert all("\x1b" not in text for text in shown)
