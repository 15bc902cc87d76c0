"""The server's edges against real uvicorn on loopback: poison sampling values, errors that
must not close keep-alive connections, TCP_NODELAY on accepted sockets and the server's
hygiene. Every refusal is a 4xx naming the field, the connection stays usable and the engine
goes on serving."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import signal
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from console.cli import serve as serve_cli
from console.cli.main import main
from engine import Engine, EngineConfig
from engine.config import ConfigError, SamplingParams
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.thread import ServerThread
from engine.store import StoreWriter, open_database, unfinished_requests
from engine.store.recovery import Resumption, resume_unfinished
from tests.serving import killed_if_left, serve_on, stopped

TOKEN = "edge-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON_TYPE = {"Content-Type": "application/json"}
NORMAL = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
VOCAB = 320  # synthetic:tiny
# The two requests that once killed the engine until a restart.
KILLERS = [
    (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "hi", "temperature": 1.0, "top_p": 7e-46}', "top_p"),
]
# (raw body, the field the refusal must name)
POISON = [
    *KILLERS,
    (b'{"prompt": "hi", "seed": -9223372036854775809}', "seed"),
    (b'{"prompt": "\\ud800 lone surrogate"}', "prompt"),
    (b'{"prompt": "hi", "model": "\\udfff"}', "model"),
    (b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", "temperature"),
    (b'{"prompt": "hi", "top_p": 1' + b"0" * 400 + b"}", "top_p"),
    (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    (b'{"prompt": "hi", "stop_token_ids": [-5]}', "stop_token_ids"),
    (b'{"prompt": "hi", "stop_token_ids": [1180591620717411303424]}', "stop_token_ids"),
    (b'{"prompt": "hi", "stop_token_ids": [320]}', "stop_token_ids"),
    (b'{"prompt": "hi", "stop_token_ids": [true]}', "stop_token_ids"),
    (b'{"prompt": "hi", "top_k": 18446744073709551616}', "top_k"),
    (b'{"prompt": "hi", "top_k": 321}', "top_k"),
    (b'{"prompt": "hi", "max_tokens": 18446744073709551616}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 4.0}', "max_tokens"),
    (b'{"prompt": "hi", "ignore_eos": "yes"}', "ignore_eos"),
    (b'{"prompt": "hi", "stream_options": {"include_usage": 1}}', "stream_options"),
    # vLLM's 400: options for a stream a plain reply would drop
    (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', "stream_options"),
    (b'{"prompt": "hi", "stream": false, "stream_options": {"include_usage": false}}',
     "stream_options"),
    (b'{"prompt": "hi", "n": 0}', "n"),
    (b'{"prompt": "hi", "best_of": 2}', "best_of"),
    (b'{"prompt": "hi", "suffix": "x"}', "suffix"),
    (b'{"prompt": "hi", "logprobs": 21}', "logprobs"),
    (b'{"prompt": "hi", "presence_penalty": 3}', "presence_penalty"),
    (b'{"prompt": "hi", "repetition_penalty": 0}', "repetition_penalty"),
    (b'{"prompt": "hi", "min_p": 1.5}', "min_p"),
    (b'{"prompt": "hi", "logit_bias": {"320": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": {"a": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "stop": [""]}', "stop"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": [[1, 2], "a"]}', "prompt"),
]


@pytest.fixture(scope="module")
def server(loop: EngineLoop) -> Iterator[ServerThread]:
    with ServerThread(create_app(loop, admin_token=TOKEN, max_body_bytes=1 << 20,
                                 body_timeout_s=0.5)) as running:
        yield running


@pytest.fixture
def connection(server: ServerThread) -> Iterator[http.client.HTTPConnection]:
    """One keep-alive connection; http.client drops it when the server says it closes."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    yield conn
    conn.close()


def exchange(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict, bool]:
    """(status, JSON body, whether the connection stays open)."""
    conn.request(method, path, body=body, headers={**JSON_TYPE, **(headers or {})})
    response = conn.getresponse()
    data = json.loads(response.read())
    return response.status, data, not response.will_close


@pytest.mark.parametrize(("body", "field"), POISON)
def test_poison_values_get_a_4xx_naming_the_field_on_a_live_connection(
        connection: http.client.HTTPConnection, loop: EngineLoop, body: bytes,
        field: str) -> None:
    status, data, kept = exchange(connection, "POST", "/v1/completions", body)
    assert status == 400, data
    assert data["error"]["param"] == field and field in data["error"]["message"]
    assert kept, "a refusal closed the keep-alive connection"
    status, data, kept = exchange(connection, "POST", "/v1/completions",
                                  json.dumps(NORMAL).encode())
    assert status == 200 and len(data["choices"][0]["token_ids"]) == 2 and kept
    assert loop.error is None


@pytest.mark.parametrize(("body", "field"), KILLERS)
def test_each_engine_killer_is_followed_by_normal_requests_that_all_succeed(
        connection: http.client.HTTPConnection, loop: EngineLoop, body: bytes,
        field: str) -> None:
    assert exchange(connection, "POST", "/v1/completions", body)[0] == 400
    for _ in range(20):  # benchmarks/fuzz_server.py --killers runs 100 after each
        status, data, _kept = exchange(connection, "POST", "/v1/completions",
                                       json.dumps(NORMAL).encode())
        assert status == 200, data
    assert loop.error is None


def test_json_nested_100000_deep_is_a_400(connection: http.client.HTTPConnection) -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000,
                 b'{"prompt": "hi", "x": ' + b"[" * 40 + b"]" * 40 + b"}"):
        status, data, kept = exchange(connection, "POST", "/v1/completions", body)
        assert status == 400 and "deeper than" in data["error"]["message"] and kept


@pytest.mark.parametrize("shares", [None, [1], {"a": None}, {"a": [1]}, {"a": "x"},
                                    {"a": 1e400}])
def test_admin_tenant_shares_of_the_wrong_type_get_422(
        connection: http.client.HTTPConnection, loop: EngineLoop, shares: object) -> None:
    before = loop.engine.config.tenant_shares
    status, data, kept = exchange(connection, "PATCH", "/v1/admin/config",
                                  json.dumps({"tenant_shares": shares}).encode(), AUTH)
    assert status == 422 and data["error"]["param"] == "tenant_shares" and kept
    assert loop.engine.config.tenant_shares == before


@pytest.mark.parametrize(("body", "field"), [({"tenant_priorities": {"a": 2**70}},
                                              "tenant_priorities"),
                                             ({"guard_window_s": "Infinity"}, "guard_window_s"),
                                             ({"chunk_tile": 2**64}, "chunk_tile")])
def test_admin_values_out_of_range_get_422(connection: http.client.HTTPConnection,
                                           body: dict, field: str) -> None:
    status, data, _kept = exchange(connection, "PATCH", "/v1/admin/config",
                                   json.dumps(body).encode(), AUTH)
    assert status == 422 and data["error"]["param"] == field


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", ""])
def test_only_json_bodies_are_read(client: httpx.Client, content_type: str) -> None:
    response = client.post("/v1/completions", content=json.dumps(NORMAL),
                           headers={"Content-Type": content_type})
    assert response.status_code == 415 and "application/json" in response.text
    ok = client.post("/v1/completions", content=json.dumps(NORMAL),
                     headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as http_client:
        yield http_client


@pytest.mark.parametrize(("host", "status"), [("evil.example", 400), ("evil.example:80", 400),
                                              ("127.0.0.1.evil.example", 400), ("", 400),
                                              ("localhost", 200), ("LOCALHOST:8000", 200),
                                              ("127.0.0.1:1", 200), ("[::1]:8000", 200)])
def test_host_allow_list(client: httpx.Client, host: str, status: int) -> None:
    response = client.get("/v1/models", headers={"Host": host})
    assert response.status_code == status
    if status == 400:
        assert "--allow-host" in response.json()["error"]["message"]


def test_allow_host_names_more_hosts(loop: EngineLoop) -> None:
    app = create_app(loop, admin_token=None, allowed_hosts=["127.0.0.1", "tokenflow.lan"])
    with ServerThread(app) as running, httpx.Client(base_url=running.url) as http_client:
        assert http_client.get("/health", headers={"Host": "tokenflow.lan:8000"}).is_success
        assert http_client.get("/health", headers={"Host": "localhost"}).status_code == 400


def test_a_body_that_never_arrives_is_cut_off(server: ServerThread,
                                              loop: EngineLoop) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        reply = b""
        while chunk := raw.recv(4096):  # the server answers, then closes
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b"Content-Length declares" in reply
    assert loop.error is None


def test_accepted_sockets_have_tcp_nodelay(server: ServerThread,
                                           connection: http.client.HTTPConnection) -> None:
    exchange(connection, "GET", "/health")
    sockets = [c.transport.get_extra_info("socket")
               for c in server.server.server_state.connections]
    assert sockets, "the server holds no connection"
    assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"temperature": 1.0, "top_p": 7e-46}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 10**400}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"top_k": 2**64}, "top_k"), ({"top_k": -1}, "top_k"), ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"stop_token_ids": (-5,)}, "stop_token_ids"), ({"stop_token_ids": (2**70,)},
                                                    "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_sampling_params_refuse_the_same_poison(kwargs: dict, field: str) -> None:
    """The Python API and a resume from the journal build SamplingParams too."""
    with pytest.raises(ConfigError) as refused:
        SamplingParams(**kwargs)
    assert refused.value.field == field


def test_sampling_params_accept_the_edges_and_check_a_vocabulary() -> None:
    params = SamplingParams(max_tokens=1, temperature=2, top_p=1.2e-38, top_k=VOCAB,
                            seed=2**64 - 1, stop_token_ids=[0, VOCAB - 1])
    assert params.temperature == 2.0 and isinstance(params.temperature, float)
    assert params.stop_token_ids == (0, VOCAB - 1)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    params.check_vocab(VOCAB)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        SamplingParams(stop_token_ids=(VOCAB,)).check_vocab(VOCAB)
    with pytest.raises(ConfigError, match="vocabulary size"):
        SamplingParams(top_k=VOCAB + 1).check_vocab(VOCAB)


@pytest.mark.slow  # starts tokenflow serve twice
def test_poison_never_reaches_the_journal_so_a_restart_resumes_nothing(
        tmp_path: Path) -> None:
    database = open_database(tmp_path / "journal.db")
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    writer = StoreWriter(database, engine.bus)
    loop = EngineLoop(engine).start()
    try:
        with ServerThread(create_app(loop, admin_token=None)) as running, \
                httpx.Client(base_url=running.url, timeout=60) as http_client:
            long_prompt = " ".join(["word"] * 300)  # over 256 tokens: journalled first
            for body, _field in KILLERS:
                poisoned = json.loads(body) | {"prompt": long_prompt}
                sent = json.dumps(poisoned).encode()
                assert http_client.post("/v1/completions", content=sent,
                                        headers=JSON_TYPE).status_code == 400
            assert http_client.post("/v1/completions", json=NORMAL).status_code == 200
    finally:
        loop.stop()
        writer.close()
    restarted = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    assert resume_unfinished(restarted, database) == Resumption((), (), ())
    database.close()


@pytest.mark.slow  # starts and stops tokenflow serve
def test_serve_stopped_by_sigterm_flushes_its_journal_and_exits_0(tmp_path: Path) -> None:
    """uvicorn re-raised SIGTERM after its graceful shutdown and killed `tokenflow serve`
    before the store writer's last batch: the last finished request stayed DECODING in the
    journal and the next start ran it again (found by benchmarks/fuzz_server.py)."""
    db = tmp_path / "serve.db"
    with killed_if_left(serve_on(db)) as server:
        assert server.stdout is not None
        banner = server.stdout.readline()  # printed once the server is about to accept
        url = re.search(r"http://[^,\s]+", banner)
        assert url, banner + server.stderr.read() if server.stderr else banner
        with httpx.Client(base_url=url.group(0), timeout=60) as http_client:
            for _ in range(3):
                assert http_client.post("/v1/completions", json=NORMAL).status_code == 200
        stopped(server)
    database = open_database(db)
    try:
        with database.session() as session:
            assert unfinished_requests(session) == []
    finally:
        database.close()


@pytest.mark.slow  # starts tokenflow serve
def test_serve_whose_journal_stops_stops_serving_with_a_clear_error(tmp_path: Path) -> None:
    """A permanent journal error (here a table dropped under the running server) stops the
    server with exit 2 and the fix, instead of serving on unrecorded (a journal that never
    lies)."""
    db = tmp_path / "serve.db"
    with killed_if_left(serve_on(db)) as server:
        assert server.stdout is not None
        url = re.search(r"http://[^,\s]+", server.stdout.readline())
        assert url
        with contextlib.closing(sqlite3.connect(db)) as connection:
            connection.execute("DROP TABLE request_journal")  # the schema says head; it is not
        # the request that meets the broken journal; its answer may be cut off
        with httpx.Client(base_url=url.group(0), timeout=60) as http_client, \
                contextlib.suppress(httpx.HTTPError):
            http_client.post("/v1/completions", json=NORMAL)
        _out, err = server.communicate(timeout=120)
    assert server.returncode == 2, err
    assert "the journal in" in err and "tokenflow db upgrade" in err and "Traceback" not in err


def test_serve_on_a_store_missing_a_table_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "old.db"
    open_database(db).close()
    with contextlib.closing(sqlite3.connect(db)) as connection:
        connection.execute("DROP TABLE request_journal")
    assert main(["serve", "--model", "synthetic:tiny", "--device", "cpu", "--port", "0",
                 "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "schema is missing tables" in err and len(err.strip().splitlines()) == 1


def test_serve_says_where_it_listens_only_once_a_stop_is_graceful(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever reads the banner may send SIGTERM at once: by then the handler that lets the
    journal flush must be in place, not the default that kills the process."""
    at_banner: list[object] = []

    class Server:
        should_exit = False

        def run(self, sockets: list[socket.socket]) -> None:
            assert at_banner, "the banner comes before serving"

    monkeypatch.setattr(serve_cli, "print", lambda *_a, **_k: at_banner.append(
        signal.getsignal(signal.SIGTERM)), raising=False)
    before = signal.getsignal(signal.SIGTERM)
    serve_cli._serve_until_signalled(Server(), socket.socket(), "tokenflow serve: ...")
    assert at_banner[0] not in (before, signal.SIG_DFL)
    assert signal.getsignal(signal.SIGTERM) == before


def test_unknown_fields_are_ignored_and_said_in_the_log_as_text(
        caplog: pytest.LogCaptureFixture) -> None:
    from engine.serve.protocol import ChatBody, CompletionBody, TokenizeBody, parse_model

    with caplog.at_level(logging.WARNING, logger="tokenflow.serve.fields"):
        body = parse_model(CompletionBody, {"prompt": "hi", "user": "u", "\x1b[31mred": 1,
                                            **{f"x{n}": n for n in range(9)}})
        parse_model(ChatBody, {"messages": [{"role": "user", "content": "hi"}],
                               "response_format": {"type": "text"}, "max_tokens": 2})
        parse_model(TokenizeBody, {"prompt": "hi", "return_token_strs": True})
    assert body.prompt == "hi"
    (line,) = [r.getMessage() for r in caplog.records]  # the others knew every field
    assert line.startswith('fields present in the request but ignored: "\\u001b[31mred", "user"')
    assert line.endswith(" and 3 more") and "\x1b" not in line


def test_a_chat_part_that_is_not_text_is_named_with_the_fix() -> None:
    from engine.serve.protocol import ApiError, ChatBody, parse_model

    def refused(content: object) -> str:
        with pytest.raises(ApiError) as raised:
            parse_model(ChatBody, {"messages": [{"role": "user", "content": content}]})
        assert raised.value.param == "messages"
        return raised.value.message

    image = refused([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}])
    assert image.startswith("'messages[0].content': part 0 is of type \"image_url\": this "
                            "server reads text parts")
    assert "need a multimodal model" in image and "valid string" not in image
    assert "part 1 is of type null" in refused([{"type": "text", "text": "a"}, 5])
    assert "part 0 is of type \"input_audio\"" in refused([{"type": "input_audio"}])
    body = parse_model(ChatBody, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert body.messages[0].text() == "ab"


def test_a_field_of_several_types_says_them_all_at_its_own_path() -> None:
    from engine.serve.protocol import ApiError, ChatBody, CompletionBody, parse_model

    def said(model: type, body: dict[str, object]) -> str:
        with pytest.raises(ApiError) as raised:
            parse_model(model, body)
        return raised.value.message

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert said(ChatBody, {**chat, "guided_json": 5}) == (
        "'guided_json': input should be a valid string or a valid dictionary")
    assert said(ChatBody, {"messages": [{"role": "user", "content": 5}]}) == (
        "'messages[0].content': input should be a valid string or a valid list")
    assert said(CompletionBody, {"prompt": "a", "structured_outputs": {"json": 5}}) == (
        "'structured_outputs.json': input should be a valid string or a valid dictionary")
    assert said(CompletionBody, {"prompt": "a", "max_tokens": "x"}) == (
        "'max_tokens': input should be a valid integer")  # one type: said once
