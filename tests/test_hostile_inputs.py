"""The smaller doors: request files nested to exhaust the parser or naming tokens no model
has, integers through floats, idle and slow connections, log floods, and a config patch
racing the step that applies the last one."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import http.client
import itertools
import json
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, field_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from uvicorn.server import ServerState

from console.cli.main import main
from engine import Engine, EngineConfig, SamplingParams
from engine.batch import RequestOutput
from engine.config import ConfigError
from engine.harness.workload import WorkloadError, load_requests_jsonl, request_lines
from engine.serve.connections import (
    AcceptBackoff,
    AcceptErrorLog,
    GuardedServer,
    server_config,
)
from engine.serve.listener import listen
from engine.serve.log_limit import RateLimitedLog, client_and_status
from engine.serve.loop import EngineLoop
from engine.serve.memory import IdleTrim, freeze_startup_heap
from engine.serve.protocol import OFF_LOOP_BYTES, BodyLimits, read_model
from engine.serve.rate_limit import Rate


def test_a_deeply_nested_line_is_refused_by_line_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"id": "a", "prompt_token_ids": [1], "max_tokens": 1}\n'
                        + "[" * 200_000 + "\n")

    def no_model(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model must not load for a file that cannot be read")

    monkeypatch.setattr("console.cli.run.start_session", no_model)
    assert main(["run", "--model", "synthetic:tiny", "--requests", str(requests),
                 "--no-db"]) == 2
    err = capsys.readouterr().err
    assert f"{requests}:2: nests JSON deeper than" in err and "Traceback" not in err
    requests.write_text('{"id": "a", "x": ' + "[" * 40 + "]" * 40 + "}\n")  # parses; too deep
    with pytest.raises(WorkloadError, match=":1: nests JSON deeper"):
        request_lines(requests)
    requests.write_text('{"id": "a", "prompt_token_ids": [' + "9" * 5000 + "]}\n")
    with pytest.raises(WorkloadError, match=":1: not valid JSON"):
        request_lines(requests)


def test_token_ids_outside_the_vocabulary_name_their_line(tmp_path: Path) -> None:
    requests = tmp_path / "in.jsonl"
    good = '{"id": "a", "prompt_token_ids": [1, 2], "max_tokens": 1}\n'
    for bad, shown in ((320, "token id 320 is outside"),
                       (10**30, "token id of 31 digits is outside")):
        requests.write_text(good + f'{{"id": "b", "prompt_token_ids": [1, {bad}], '
                                   '"max_tokens": 1}\n')
        with pytest.raises(WorkloadError, match=f":2: field 'prompt_token_ids': {shown}"):
            load_requests_jsonl(requests, lambda text: [], vocab_size=320)
    assert len(load_requests_jsonl(requests, lambda text: [])) == 2  # no vocabulary: no cap


PERIODS = ("stats_window_s", "guard_window_s", "defrag_interval_s", "bandwidth_pause_s",
           "chunk_timeout_base_ms", "cadence_max_wait_ms", "auto_tpot_ms", "slo_ttft_ms",
           "slo_itl_ms", "slow_query_min_overrun_ms")


@pytest.mark.parametrize("name", PERIODS)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300, -1.0])
def test_every_window_timeout_and_pause_is_finite_and_at_most_a_day(name: str,
                                                                    value: float) -> None:
    """inf was taken for most of them: a bandwidth pause that never ended, a stats window never
    trimmed, a chunk timeout that never fired; live (the console, the admin API) or at start."""
    unit = "milliseconds" if name.endswith("_ms") else "seconds"
    with pytest.raises(ConfigError, match=rf"^{name}: must be a number of {unit} in [\[(]0, "
                                          r"86,400(,000)?\], a day at most"):
        dataclasses.replace(EngineConfig(), **{name: value}).validate()
    day = 86_400_000.0 if name.endswith("_ms") else 86_400.0
    dataclasses.replace(EngineConfig(), **{name: day}).validate()


def test_a_window_or_timeout_given_on_the_command_line_is_bounded_too(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", "synthetic:8b", "--simulate", "h100", "--workload", "chat",
                 "--num-requests", "3", "--slow-query-min-overrun-ms", "inf"]) == 2
    assert "slow_query_min_overrun_ms: must be a number of milliseconds in [0, 86,400,000]" in (
        capsys.readouterr().err)


def test_integers_stay_integers() -> None:
    big = 2**63 - 1
    assert EngineConfig().replace(max_num_batched_tokens=big).max_num_batched_tokens == big
    assert EngineConfig().replace(max_num_batched_tokens=str(big)).max_num_batched_tokens == big
    assert EngineConfig().replace(max_num_batched_tokens="512.0").max_num_batched_tokens == 512
    for bad in (2.0**60, 1.5, float("nan"), "1e30"):
        with pytest.raises(ConfigError, match="max_num_batched_tokens"):
            EngineConfig().replace(max_num_batched_tokens=bad)


class SteppingLock:
    """The engine's config lock, letting one PATCH land the moment apply releases it."""

    def __init__(self, on_release: list) -> None:
        self.lock = threading.Lock()
        self.on_release = on_release

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.lock.release()
        if self.on_release:
            self.on_release.pop()()


def test_a_patch_racing_apply_is_validated_against_the_config_it_replaces() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    engine.update_config(max_num_batched_tokens=512)
    pending: list = []
    engine._config_lock = SteppingLock(pending)  # the race's window is the point
    pending.append(lambda: engine.update_config(chunk_tile=32))
    engine.apply_pending_config()  # the PATCH lands as this releases the lock
    engine.apply_pending_config()
    assert engine.config.max_num_batched_tokens == 512  # the first PATCH was not lost
    assert engine.config.chunk_tile == 32


@pytest.fixture
def guarded_server() -> Iterator[tuple[str, int]]:
    """A server run as tokenflow runs its own: 0.3 s for headers, three connections."""
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    sock = listen("127.0.0.1", 0)
    server = GuardedServer(server_config(app, lifespan="off", log_level="critical",
                                         max_connections=3, header_timeout_s=0.3))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield sock.getsockname()[:2]
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_slow_and_idle_connections_are_closed_and_counted(
        guarded_server: tuple[str, int]) -> None:
    address = guarded_server
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    kept = http.client.HTTPConnection(*address)  # a whole request, then idle between requests
    kept.request("GET", "/")
    assert kept.getresponse().read() == b"ok"
    idle = socket.create_connection(address)
    slow = socket.create_connection(address)
    slow.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
    with socket.create_connection(address) as fourth:  # three held: the next gets 503 at once
        fourth.sendall(request)
        assert fourth.recv(100).startswith(b"HTTP/1.1 503")
    for held in (idle, slow):  # closed by the server once their headers are late
        held.settimeout(60)  # a bound on a hang, far past the 0.3 s the server allows
        assert held.recv(100) == b""
        held.close()
    kept.request("GET", "/")  # its headers came in time: it was not cut while it idled
    answer = kept.getresponse()
    assert answer.status == 200 and answer.read() == b"ok"
    kept.close()
    with socket.create_connection(address) as fresh:
        fresh.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert fresh.recv(100).startswith(b"HTTP/1.1 200")


def test_a_log_flood_passes_at_a_bounded_rate() -> None:
    now = [0.0]
    limit = RateLimitedLog(Rate(per_second=0.2, burst=10.0), clock=lambda: now[0])

    def record(text: str = "Invalid HTTP request received.") -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, "", 0, text, (), None)

    assert sum(limit.filter(record()) for _ in range(1000)) == 10
    assert limit.filter(record("Exceeded concurrency limit."))  # another kind has its own
    now[0] += 5.0
    passed = record()
    assert limit.filter(passed) and "990 more like it dropped" in passed.getMessage()
    now[0] += 10_000.0  # a gap far past the window: back to the burst, never beyond
    assert sum(limit.filter(record()) for _ in range(1000)) == 10


def test_access_lines_are_limited_per_client_and_status() -> None:
    limit = RateLimitedLog(Rate(per_second=0.2, burst=2.0), clock=lambda: 0.0,
                           kind=client_and_status)

    def access(client: str, status: int) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0,
                                 '%s - "%s %s HTTP/%s" %d',
                                 (client, "POST", "/v1/traces", "1.1", status), None)

    flood = sum(limit.filter(access(f"10.0.0.9:{port}", 401)) for port in range(1000, 1100))
    assert flood == 2  # one client's refusals, whatever port it comes from
    assert limit.filter(access("10.0.0.9:1", 200)) and limit.filter(access("10.0.0.7:1", 401))


class FakeTransport:
    """A socket's transport as the protocol sees it: what was written, whether it was closed."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": (self.peer, 4000), "sockname": ("127.0.0.1", 8000)}.get(name,
                                                                                    default)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The loop the protocols' request tasks go to; they run at the end, then it closes."""
    loop = asyncio.new_event_loop()
    yield loop
    while pending := asyncio.all_tasks(loop):
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def connections_on(loop: asyncio.AbstractEventLoop, now: list[float], per_address: int = 2
                   ) -> Callable[[str], Any]:
    """A factory of server-side protocols sharing one guard, on the clock `now`."""
    config = server_config(PlainTextResponse("ok"), lifespan="off", per_address=per_address,
                           header_timeout_s=10.0, body_timeout_s=10.0,
                           clock=lambda: now[0])
    config.load()
    state = ServerState()

    def connect(peer: str) -> Any:
        protocol = config.http_protocol_class(config=config, server_state=state,
                                              app_state={}, _loop=loop)
        transport = FakeTransport(peer)
        protocol.connection_made(transport)
        return protocol, transport
    return connect


def test_a_body_trickle_is_cut_at_its_deadline_on_the_guards_clock(
        loop: asyncio.AbstractEventLoop) -> None:
    now = [0.0]
    connect = connections_on(loop, now)
    protocol, transport = connect("10.0.0.1")
    protocol.data_received(b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
                           b"\r\n")
    for _ in range(9):  # a byte a second: the body is still coming at 9 s
        now[0] += 1.0
        protocol.data_received(b"x")
        protocol.expire()
        assert not transport.closed
    now[0] += 1.5  # past 10 s since the headers, however the bytes trickle
    protocol.expire()
    assert transport.closed
    whole, whole_transport = connect("10.0.0.2")  # a whole body in time is never cut
    whole.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
    now[0] += 1000.0
    whole.expire()
    assert not whole_transport.closed


def test_connections_are_capped_per_address_and_freed_when_they_close(
        loop: asyncio.AbstractEventLoop) -> None:
    connect = connections_on(loop, [0.0], per_address=2)
    first, _ = connect("10.0.0.1")
    connect("10.0.0.1")
    _third, refused = connect("10.0.0.1")
    assert refused.closed and refused.written.startswith(b"HTTP/1.1 503")
    assert b"too many connections from this address" in refused.written
    _other, fine = connect("10.0.0.2")  # another address has its own share
    assert not fine.closed
    first.connection_lost(None)
    _again, after = connect("10.0.0.1")
    assert not after.closed


def test_accept_errors_are_logged_once_a_second_with_a_count(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    handler = AcceptErrorLog(clock=lambda: now[0])
    error = OSError(24, "Too many open files")
    context = {"message": "socket.accept() out of system resource", "exception": error}
    with caplog.at_level(logging.ERROR, logger="tokenflow.serve"):
        for _ in range(10_000):  # a flood within one second: one line
            handler(None, context)  # type: ignore[arg-type]
        now[0] += 1.0
        handler(None, context)  # type: ignore[arg-type]
        now[0] += 3600.0  # a gap far past the interval: one line, nothing owed
        handler(None, context)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "9999 more since the last line" in lines[1] and "more since" not in lines[2]
    assert all("Traceback" not in line and "Too many open files" in line for line in lines)


# A server whose file limit is a few descriptors above what it uses, whose header deadline
# (10 minutes) never frees one: it prints its port once it accepts.
FILE_LIMITED_SERVER = """
import os, resource, sys, threading, time
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from engine.serve.connections import GuardedServer, server_config
from engine.serve.listener import listen

app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
sock = listen("127.0.0.1", 0)
server = GuardedServer(server_config(app, lifespan="off", log_level="critical",
                                     header_timeout_s=600.0))
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 24, resource.getrlimit(
    resource.RLIMIT_NOFILE)[1]))
threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
while not server.started:
    time.sleep(0.01)
print(sock.getsockname()[1], flush=True)
sys.stdin.read()
"""


def test_at_the_file_limit_idle_connections_make_room_for_a_request() -> None:
    root = Path(__file__).resolve().parents[1]
    server = subprocess.Popen([sys.executable, "-c", FILE_LIMITED_SERVER], cwd=root,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    idle: list[socket.socket] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        for _ in range(60):  # more than the descriptors left: they are never freed by time
            idle.append(socket.create_connection(("127.0.0.1", port)))
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # a hang guard
        client.request("GET", "/")
        assert client.getresponse().read() == b"ok"
        oldest = idle[0]
        oldest.settimeout(60)
        assert oldest.recv(100) == b""  # closed to make room: it had waited longest
    finally:
        for sock in idle:
            sock.close()
        server.kill()
        server.wait()


def test_accepting_pauses_briefly_at_the_file_limit_and_longer_while_it_lasts() -> None:
    backoff = AcceptBackoff((0.002, 0.01, 0.05))
    assert [backoff.failed() for _ in range(5)] == [0.002, 0.01, 0.05, 0.05, 0.05]
    backoff.accepted()
    assert backoff.failed() == 0.002


def test_memory_is_trimmed_when_the_server_goes_idle_at_most_once_an_interval() -> None:
    now = [0.0]
    trimmed = threading.Event()
    trim = IdleTrim(clock=lambda: now[0], interval_s=10.0, trim=trimmed.set)
    assert trim.idle() and trimmed.wait(10)
    now[0] += 9.0
    assert not trim.idle()  # within the interval: a burst of short requests trims once
    now[0] += 3600.0  # a gap far past the interval
    assert trim.idle() and trim.trims == 2
    assert IdleTrim().trim is not None  # glibc here: the real malloc_trim is found


def test_memory_is_trimmed_every_interval_while_a_backlog_keeps_the_engine_busy() -> None:
    now = [0.0]
    trimmed: list[float] = []
    trim = IdleTrim(clock=lambda: now[0], interval_s=10.0, busy_interval_s=60.0,
                    trim=lambda: trimmed.append(now[0]))
    assert not trim.busy()  # the first busy step starts the count
    for _ in range(60 * 3):  # three busy minutes, a step a second
        now[0] += 1.0
        trim.busy()
    assert trim.trims == 3
    now[0] += 5.0
    assert not trim.idle()  # a busy trim counts: the idle one waits out its interval
    now[0] += 7200.0  # a gap far past both intervals
    assert trim.busy() and trim.trims == 4


def test_the_engine_loop_gives_memory_back_while_it_works_and_once_idle() -> None:
    """The loop's clock advances 10 s a reading: a minute of it passes within a few steps."""
    ticks = itertools.count()
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    loop = EngineLoop(engine, clock=lambda: 10.0 * next(ticks))
    loop.trim.trim = lambda: None  # the decisions are what is tested, not glibc
    decided: list[tuple[str, bool]] = []

    def recorded(name: str) -> Callable[[], bool]:
        asked = getattr(loop.trim, name)

        def decide() -> bool:
            decided.append((name, asked()))
            return decided[-1][1]
        return decide

    loop.trim.busy = recorded("busy")  # type: ignore[method-assign]
    loop.trim.idle = recorded("idle")  # type: ignore[method-assign]
    finished: list[str] = []
    all_done = threading.Event()

    def heard(out: RequestOutput) -> None:
        if out.finished:
            finished.append(out.request_id)
            if len(finished) == 4:
                all_done.set()

    loop.start()
    try:
        for i in range(4):
            loop.submit([1, 2, 3, 4 + i], SamplingParams(max_tokens=40, ignore_eos=True),
                        on_output=heard)
        assert all_done.wait(120)
        loop.call(lambda _engine: None).result(60)  # the loop has gone round once more
    finally:
        loop.stop()
    assert ("busy", True) in decided  # trimmed while requests were in hand
    assert decided[-1] == ("idle", True)  # and once the last one ended


def test_the_start_up_heap_is_left_out_of_later_collections() -> None:
    built = [[index] for index in range(1000)]  # what start-up leaves, tracked by the collector
    try:
        assert freeze_startup_heap() >= len(built)
        later = [[0]]
        generation_2 = {id(obj) for obj in gc.get_objects(generation=2)}
        # a full collection walks only what came after the freeze
        assert not generation_2 & {id(obj) for obj in built}
        gc.collect()
        assert id(later) in {id(obj) for obj in gc.get_objects(generation=2)}
    finally:
        gc.unfreeze()


class _Recorded(BaseModel):
    """A body whose validation says which thread ran it."""

    stop: list[str]

    @field_validator("stop")
    @classmethod
    def _seen(cls, value: list[str]) -> list[str]:
        VALIDATED_ON.append(threading.get_ident())
        return value


VALIDATED_ON: list[int] = []


@pytest.mark.parametrize("strings, off_loop", [(10, False), (20_000, True)])
def test_a_large_body_is_parsed_off_the_event_loop(strings: int, off_loop: bool) -> None:
    raw = json.dumps({"stop": [f"{i:x}" for i in range(strings)]}).encode()
    assert (len(raw) >= OFF_LOOP_BYTES) is off_loop

    async def read() -> int:
        sent = False

        async def receive() -> dict[str, object]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        request = Request({"type": "http", "method": "POST", "path": "/", "headers": [
            (b"content-type", b"application/json")]}, receive)
        body = await read_model(request, _Recorded, BodyLimits())
        assert len(body.stop) == strings
        return threading.get_ident()

    VALIDATED_ON.clear()
    loop_thread = asyncio.run(read())
    assert ([loop_thread] != VALIDATED_ON) is off_loop and len(VALIDATED_ON) == 1
