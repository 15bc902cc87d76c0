"""Attached servers that answer badly: NaN and absurd figures, answers that trickle or never
end, bombs, and a server that would collect another's token. Each is scaled down: caps and
deadlines are small, clocks are injected."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from console.errors import UserError
from console.sources import HttpSource, VllmMetricsSource, open_http_source
from console.sources.attach import detect_kind
from console.sources.base import SourceError
from console.sources.fleet import FleetSource, retry_delay
from console.sources.remote import FIRST_DELAY_S, MAX_DELAY_S, Remote
from engine.serve.auth import TOKEN_ENV
from engine.serve.thread import ServerThread
from engine.snapshot import Snapshot

GOOD = Snapshot(model="good", tokens_per_s=369.0, kv_usage=0.5).to_dict()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stats(**changes: object) -> str:
    """A /v1/stats body as a hostile server writes it (json.dumps writes NaN and Infinity)."""
    return json.dumps({**GOOD, **changes})


def answering(body: Callable[[], str]) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(
        200, text=body(), headers={"Content-Type": "application/json"}))


def test_non_finite_figures_are_unknown_never_live() -> None:
    clock = Clock()
    body = [stats(kv_usage=float("nan"))]
    source = HttpSource("http://tf.test", clock=clock, transport=answering(lambda: body[0]))
    with pytest.raises(SourceError, match="kv_usage is nan"):
        source.snapshot()
    assert not source.online  # shown down with the reason, and backing off
    clock.now += MAX_DELAY_S + 1
    body[0] = stats(prefix_cache_hit_rate=float("inf"), bandwidth_bytes_per_s=float("nan"),
                    ttft_ms={"p50": 1.0, "p90": float("nan"), "p99": float("-inf")})
    snapshot = source.snapshot()  # optional figures that are not finite are unknown: None
    assert snapshot.prefix_cache_hit_rate is None and snapshot.bandwidth_bytes_per_s is None
    assert (snapshot.ttft_ms.p50, snapshot.ttft_ms.p90, snapshot.ttft_ms.p99) == (1.0, None, None)
    for bad, named in ((stats(num_running="12"), "num_running"),
                       (stats(config={"cache_high_watermark": float("nan")}),
                        "cache_high_watermark"),
                       (stats(requests=[{"id": "x"}]), "RequestView without"),
                       ("[" * 100_000, "not a JSON snapshot"), ("[]", "expected an object")):
        clock.now += MAX_DELAY_S + 1
        body[0] = bad
        with pytest.raises(SourceError, match=named):
            source.snapshot()
    source.close()


VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} %s
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="%s"} 1
"""


def test_a_vllm_gauge_that_is_not_finite_is_never_shown() -> None:
    clock = Clock()
    text = [VLLM % ("NaN", "100")]
    source = VllmMetricsSource("http://vllm.test", clock=clock, transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text=text[0])))
    with pytest.raises(SourceError, match="kv_cache_usage_perc is nan"):
        source.snapshot()
    for usage in ("+Inf", "-Inf"):
        clock.now += MAX_DELAY_S + 1
        text[0] = VLLM % (usage, "100")
        with pytest.raises(SourceError, match=r"is -?inf"):
            source.snapshot()
    clock.now += MAX_DELAY_S + 1
    text[0] = VLLM % ("0.25", "nan")  # an unreadable block count is unknown: 0
    snapshot = source.snapshot()
    assert snapshot.kv_usage == 0.25 and snapshot.kv_blocks_total == 0
    source.close()


def test_a_fleet_poller_survives_any_failure_and_backs_off() -> None:
    clock = Clock()
    sick = [stats(kv_usage=float("nan"))]
    members = [HttpSource("http://sick.test", clock=clock, transport=answering(lambda: sick[0])),
               HttpSource("http://well.test", transport=answering(stats))]
    fleet = FleetSource(members, interval=0.01)
    try:
        assert fleet.wait_for(lambda: all(s.polls >= 3 for s in fleet.states), timeout=30)
        rows = {row.name: row for row in fleet.rows()}
        assert rows["http://sick.test"].health == "down"
        assert "kv_usage is nan" in rows["http://sick.test"].error
        assert rows["http://sick.test"].tokens_per_s is None  # never a frozen figure
        assert rows["http://well.test"].health == "up"
        assert rows["http://well.test"].tokens_per_s == 369.0
        sick[0] = stats()  # it recovers; past its back-off it is polled, and up again
        clock.now += MAX_DELAY_S + 1
        assert fleet.wait_for(lambda: fleet.states[0].up, timeout=30)
    finally:
        fleet.close()


def test_a_server_whose_store_is_unreachable_shows_degraded_in_the_fleet() -> None:
    store = [{"state": "unreachable", "since_s": 12.4, "held_events": 340, "error": "refused"}]
    members = [HttpSource("http://tf.test", transport=answering(
        lambda: json.dumps({**GOOD, "store": store[0]})))]
    fleet = FleetSource(members, interval=0.01)
    try:
        assert fleet.wait_for(lambda: fleet.states[0].polls >= 2, timeout=30)
        row = fleet.rows()[0]
        assert row.health == "degraded" and row.tokens_per_s == 369.0  # still serving
        assert row.error == "store unreachable 12 s, 340 events held"
        store[0] = {"state": "ok", "since_s": None, "held_events": 0, "error": None}
        assert fleet.wait_for(lambda: fleet.rows()[0].health == "up", timeout=30)
    finally:
        fleet.close()
    absurd = HttpSource("http://tf.test", transport=answering(lambda: json.dumps(
        {**GOOD, "store": {"state": "unreachable", "since_s": 1.7e308}})))
    absurd.snapshot()  # an absurd figure is unknown, the state still said
    assert absurd.store_note == "store unreachable"
    absurd.close()
    for bad in ({"state": "nope"}, {"state": "unreachable", "held_events": "9"}, "x"):
        source = HttpSource("http://tf.test", transport=answering(
            lambda bad=bad: json.dumps({**GOOD, "store": bad})))
        with pytest.raises(SourceError, match="store"):
            source.snapshot()
        source.close()


def test_retries_back_off_doubling_to_a_cap() -> None:
    assert retry_delay(0.4, 0) == 0.4
    assert [retry_delay(0.4, n) for n in (1, 2, 3)] == [0.8, 1.6, 3.2]
    assert retry_delay(0.4, 10_000) == MAX_DELAY_S  # a long outage waits the cap, no more
    clock = Clock()
    remote = Remote("http://down.test", clock=clock, transport=httpx.MockTransport(
        lambda request: httpx.Response(503)))
    with pytest.raises(SourceError, match="HTTP 503"):
        remote.request("GET", "/")
    clock.now += FIRST_DELAY_S / 2  # inside the back-off: no request goes out
    with pytest.raises(SourceError, match="offline"):
        remote.request("GET", "/")
    assert remote.delay_s == FIRST_DELAY_S
    remote.close()


def trickle(timer: Clock, total: int, chunk: bytes = b"v") -> Iterator[bytes]:
    """A body that arrives a chunk a second (the injected timer's second)."""
    for _ in range(total):
        timer.now += 1.0
        yield chunk


def test_a_trickling_metrics_endpoint_meets_the_total_deadline() -> None:
    timer = Clock()
    sent = trickle(timer, 1000)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=sent))
    with pytest.raises(UserError, match="no whole answer within 5 s"):
        detect_kind("http://slow.test", timer=timer, transport=transport)
    assert timer.now < 10  # gave up at the deadline, not after the 1,000 s the body takes


def test_an_answer_past_the_size_cap_is_cut_off() -> None:
    timer = Clock()
    endless = trickle(timer, 10**6, b"x" * 65536)
    remote = Remote("http://big.test", max_bytes=1 << 20, deadline=1e9, timer=timer,
                    transport=httpx.MockTransport(lambda r: httpx.Response(200, content=endless)))
    with pytest.raises(SourceError, match="more than 1048576 bytes"):
        remote.request("GET", "/metrics")
    assert timer.now <= 17  # read up to the cap, not the half terabyte on offer
    declared = Remote("http://big.test", max_bytes=1000, transport=httpx.MockTransport(
        lambda r: httpx.Response(200, headers={"Content-Length": "5000000000"},
                                 content=iter([b"x"]))))
    with pytest.raises(SourceError, match="more than 1000 bytes"):
        declared.request("GET", "/metrics")
    bomb = Remote("http://bomb.test", transport=httpx.MockTransport(
        lambda r: httpx.Response(200, headers={"Content-Encoding": "gzip"},
                                 content=iter([b"\x1f\x8b"]))))
    with pytest.raises(SourceError, match="Content-Encoding 'gzip'"):
        bomb.request("GET", "/metrics")
    for opened in (remote, declared, bomb):
        opened.close()


def test_headers_that_trickle_are_cut_off_by_the_watchdog() -> None:
    """A real socket, as no transport double blocks inside the header read: the server
    sends its status line a byte at a time and never finishes."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()
    offered = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000  # 500 s of it, a byte a tick
    sent = [0]

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)
            for byte in offered:
                if done.wait(0.05):
                    return
                try:
                    connection.send(bytes([byte]))
                except OSError:
                    return
                sent[0] += 1

    threading.Thread(target=serve, daemon=True).start()
    host, port = listener.getsockname()
    remote = Remote(f"http://{host}:{port}", timeout=0.5, deadline=0.5)
    try:
        with pytest.raises(SourceError, match=r"no whole answer within 0\.5 s"):
            remote.request("GET", "/metrics")
        assert sent[0] < len(offered)  # it gave up while the headers were still coming
    finally:
        done.set()
        remote.close()
        listener.close()


@pytest.fixture
def two_servers() -> Iterator[tuple[ServerThread, ServerThread, dict[str, list[str]]]]:
    """Two tokenflow-like servers that write down every Authorization header they get."""
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def app(name: str) -> Starlette:
        async def metrics(request: Request) -> Response:
            seen[name].append(request.headers.get("authorization", ""))
            return PlainTextResponse("# TYPE tokenflow:up gauge\ntokenflow:up 1\n")

        async def snapshot(request: Request) -> Response:
            seen[name].append(request.headers.get("authorization", ""))
            return PlainTextResponse(stats(), media_type="application/json")

        return Starlette(routes=[Route("/metrics", metrics), Route("/v1/stats", snapshot)])

    with ServerThread(app("a")) as a, ServerThread(app("b")) as b:
        yield a, b, seen


def test_a_token_goes_only_to_the_server_it_was_given_for(
        two_servers: tuple[ServerThread, ServerThread, dict[str, list[str]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, seen = two_servers
    monkeypatch.setenv(TOKEN_ENV, "admin-secret")  # never sent unless given for a server
    fleet = open_http_source([a.url, b.url], tokens={a.url: "a-only"})
    assert isinstance(fleet, FleetSource)
    try:
        assert fleet.wait_for(lambda: all(s.polls >= 2 and s.up for s in fleet.states),
                              timeout=30)
    finally:
        fleet.close()
    assert seen["a"] and set(seen["a"]) == {"Bearer a-only"}
    assert seen["b"] and set(seen["b"]) == {""}


def test_token_flags_name_their_server(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.console import build_parser, main

    args = build_parser().parse_args(["--attach", "http://a:1", "--token-env", "A_TOKEN",
                                      "--attach", "http://b:1"])
    assert args.attach_tokens == {"http://a:1": "A_TOKEN"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--token-env", "A_TOKEN"])
    assert "follows the --attach URL" in capsys.readouterr().err
    monkeypatch.delenv("A_TOKEN", raising=False)
    assert main(["--attach", "http://127.0.0.1:9", "--token-env", "A_TOKEN"]) == 2
    assert "$A_TOKEN is not set" in capsys.readouterr().err


def test_finite_but_absurd_figures_are_unknown_or_refused() -> None:
    clock = Clock()
    body = [stats(prefix_cache_hit_rate=1.7e308, ttft_ms={"p50": -1.7e308, "p90": 1.0,
                                                         "p99": 2.0})]
    source = HttpSource("http://tf.test", clock=clock, transport=answering(lambda: body[0]))
    snapshot = source.snapshot()
    assert snapshot.prefix_cache_hit_rate is None and snapshot.ttft_ms.p50 is None
    for bad, named in ((stats(tokens_per_s=1.7e308), "tokens_per_s"),
                       (stats(num_running=2**70), "num_running"),
                       (stats(config={"cache_high_watermark": -1.7e308}),
                        "cache_high_watermark")):
        clock.now += MAX_DELAY_S + 1
        body[0] = bad
        with pytest.raises(SourceError, match=named):
            source.snapshot()
    source.close()


SLOW = {"id": 1, "created_at": 1.78e9, "request_id": "r", "tenant": "t", "tag": None,
        "budget_score": 2.0, "prompt_tokens": 4, "prefill_s": 0.02, "budgeted_s": 0.01,
        "chunks": [{"index": 0, "tokens": 4, "duration_s": 0.01}], "config": {},
        "server": "box"}


def test_a_score_that_is_no_number_reads_as_unknown() -> None:
    # budget_score is optional (an SLO breach stored before any calibration has none), so a
    # NaN or an absurd score is shown as unknown, never drawn
    for score in (float("nan"), 1.7e308):
        body = json.dumps({"data": [{**SLOW, "budget_score": score}]})
        source = HttpSource("http://tf.test", transport=answering(lambda body=body: body))
        assert source.slow_queries()[0].budget_score is None
        source.close()


@pytest.mark.parametrize(("change", "named"), [
    ({"budget_score": "3.5"}, "budget_score"), ({"prefill_s": float("nan")}, "prefill_s"),
    ({"prefill_s": 1.7e308}, "prefill_s"), ({"server": 5}, "server"),
    ({"chunks": [{"tokens": 1.7e308}]}, "chunks"), ({"chunks": "x"}, "chunks"),
    ({"config": {"max_num_batched_tokens": float("inf")}}, "config"),
    ({"cause_share": "0.5"}, "cause_share"), ({"timeline": {"s": [1e400]}}, "timeline"),
])
def test_every_slow_query_field_is_checked(change: dict[str, object], named: str) -> None:
    good = json.dumps({"data": [SLOW]})
    source = HttpSource("http://tf.test", transport=answering(lambda: good))
    assert source.slow_queries()[0].budget_score == 2.0
    source.close()
    bad = json.dumps({"data": [{**SLOW, **change}]})
    source = HttpSource("http://tf.test", transport=answering(lambda: bad))
    with pytest.raises(SourceError, match=named):
        source.slow_queries()
    source.close()


def test_slow_queries_of_the_wrong_shape_are_named_not_raised_raw() -> None:
    for body in ('{"data": [{"id": 1}]}', '{"data": 5}', '[]', "[" * 100_000):
        source = HttpSource("http://tf.test", transport=answering(lambda body=body: body))
        with pytest.raises(SourceError, match=r"cannot read|without its created_at"):
            source.slow_queries()
        source.close()
