"""Attached consoles: HttpSource on a live `tokenflow serve`, VllmMetricsSource on recorded
vLLM /metrics, the offline/reconnect state, and the fleet of several targets."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from textual.pilot import Pilot

from console.sources import FleetSource, HttpSource, VllmMetricsSource, open_http_source
from console.sources.base import Source, SourceError
from console.sources.embedded import EmbeddedSource
from console.sources.remote import FIRST_DELAY_S
from console.tui.app import TokenflowApp
from console.tui.widgets.header import EngineHeader
from engine import Engine, EngineConfig
from engine.config import ConfigError
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.session import EngineSession
from engine.serve.thread import ServerThread
from engine.snapshot import Snapshot
from engine.store import SlowQueryRecord, StoreWriter, open_database

TOKEN = "attach-token"
VLLM_METRICS = Path(__file__).parent / "data" / "vllm_metrics.txt"
VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SLOW = SlowQueryRecord(id=7, created_at=1.7e9, request_id="r-7", tenant="default", tag=None,
                       budget_score=2.5, prompt_tokens=300, prefill_s=0.5, budgeted_s=0.2,
                       chunks=[{"index": 0, "tokens": 300}], config={"chunk_tile": 16})
FAST_POLL_S = 0.02


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


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
    assert attached.drift_events() == [] and attached.config_changes() == []
    with pytest.raises(SourceError, match="tokenflow calibrate"):
        attached.recalibrate(lambda fraction, note: None)


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


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[ServerThread]:
    text = VLLM_METRICS.read_text()

    async def metrics(_request: Request) -> PlainTextResponse:
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    with ServerThread(Starlette(routes=[Route("/metrics", metrics)])) as running:
        yield running


def test_vllm_metrics_become_a_snapshot(vllm_server: ServerThread) -> None:
    source = VllmMetricsSource(vllm_server.url)
    snapshot = source.snapshot()
    source.close()
    assert snapshot.model == VLLM_MODEL and snapshot.mode == "vLLM"
    assert (snapshot.num_running, snapshot.num_waiting) == (12, 3)
    assert snapshot.kv_usage == pytest.approx(0.42317708)
    assert snapshot.preemptions_total == 7
    assert (snapshot.prompt_tokens_total, snapshot.generation_tokens_total) == (1843210, 512877)
    assert snapshot.requests_finished_total == 1813
    # TTFT: 906.5th of 1813 lies in (0.1, 0.25] s, 143.5 of its 540 in: Prometheus' estimate
    assert snapshot.ttft_ms.p50 == pytest.approx((0.1 + 0.15 * 143.5 / 540) * 1000)
    assert 1000 < snapshot.ttft_ms.p99 <= 2500
    assert 25 < snapshot.tpot_ms.p50 <= 50  # inter-token latency
    assert snapshot.step_ms.p50 is None and snapshot.chunk_queue_length == 0


def test_vllm_source_is_read_only(vllm_server: ServerThread) -> None:
    source = VllmMetricsSource(vllm_server.url)
    with pytest.raises(SourceError, match="read-only"):
        source.update_config(max_num_batched_tokens=512)
    with pytest.raises(SourceError):
        source.pause()
    assert source.slow_queries() == []
    source.close()


def test_a_non_vllm_endpoint_is_named(server: ServerThread) -> None:
    source = VllmMetricsSource(server.url)  # a tokenflow server: no vllm: metrics
    with pytest.raises(SourceError, match="no vllm: metrics"):
        source.snapshot()
    source.close()


def test_several_targets_open_as_a_fleet(server: ServerThread,
                                         vllm_server: ServerThread) -> None:
    fleet = open_http_source([server.url], vllm_server.url)
    assert isinstance(fleet, FleetSource) and len(fleet.members) == 2
    assert fleet.snapshot().model == "synthetic:tiny"
    fleet.select(1)
    assert fleet.snapshot().model == VLLM_MODEL and fleet.name.startswith("[2/2] vLLM")
    with pytest.raises(SourceError):
        fleet.select(2)
    fleet.close()
    single = open_http_source([server.url])
    assert isinstance(single, HttpSource)
    single.close()


async def _first_snapshot(pilot: Pilot) -> Snapshot:
    app = pilot.app
    assert isinstance(app, TokenflowApp)
    for _ in range(500):
        if app.latest is not None:
            break
        await pilot.pause(FAST_POLL_S)
    await pilot.pause()
    assert app.latest is not None, "the console never received a snapshot"
    return app.latest


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["tokenflow", "vllm"])
async def test_console_renders_an_attached_source(kind: str, server: ServerThread,
                                                  vllm_server: ServerThread) -> None:
    source: Source = (HttpSource(server.url, token=TOKEN) if kind == "tokenflow"
                      else VllmMetricsSource(vllm_server.url))
    app = TokenflowApp(source, interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        latest = await _first_snapshot(pilot)
        header = str(app.screen.query_one(EngineHeader).render())
        assert latest.mode in header
        expected = "synthetic:tiny" if kind == "tokenflow" else VLLM_MODEL
        assert latest.model == expected
        assert dataclasses.asdict(latest).keys() == dataclasses.asdict(Snapshot()).keys()
        app.collector.stop()  # no poll may land while the app tears its screens down
        await app.workers.wait_for_complete()
        await pilot.pause()
