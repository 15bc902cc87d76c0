"""`tokenflow serve` over real uvicorn on loopback, with a synthetic tiny engine."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from console.cli.main import main
from engine import Engine, EngineConfig
from engine.batch import RequestOutput
from engine.config import SamplingParams
from engine.errors import EngineError
from engine.events import Event, Finished
from engine.model.tokenizer import ByteTokenizer
from engine.ops.metrics import TTFT_BUCKETS
from engine.serve.app import create_app
from engine.serve.auth import TOKEN_ENV, load_admin_token
from engine.serve.completions import Choice, Texts
from engine.serve.loop import EngineLoop
from engine.serve.thread import ServerThread

TOKEN = "test-admin-token"
MODEL = "synthetic:tiny"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY_LIMIT = 8192


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    engine = Engine(EngineConfig(model=MODEL, device="cpu", dtype="float32",
                                 max_prefill_tokens=64))
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def server(loop: EngineLoop) -> Iterator[ServerThread]:
    app = create_app(loop, admin_token=TOKEN, max_queue=64, max_body_bytes=BODY_LIMIT)
    with ServerThread(app) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


def complete(client: httpx.Client, **body: object) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})


def test_completion_from_token_ids(client: httpx.Client) -> None:
    response = complete(client, prompt=[5, 6, 7, 8], max_tokens=6, ignore_eos=True)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    again = complete(client, prompt=[[5, 6, 7, 8]], max_tokens=6, ignore_eos=True).json()
    assert again["choices"][0]["token_ids"] == choice["token_ids"]  # greedy: deterministic


def test_text_prompt_equals_its_token_ids(client: httpx.Client, loop: EngineLoop) -> None:
    ids = loop.engine.tokenizer.encode("hello tokenflow")
    by_text = complete(client, prompt="hello tokenflow", max_tokens=5, ignore_eos=True).json()
    by_ids = complete(client, prompt=ids, max_tokens=5, ignore_eos=True).json()
    assert by_text["choices"][0]["token_ids"] == by_ids["choices"][0]["token_ids"]
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    tokens = by_text["choices"][0]["token_ids"]
    # a trailing incomplete character is held back (test_incomplete_utf8_is_held_back...)
    assert by_text["choices"][0]["text"] == loop.engine.tokenizer.decode(tokens).rstrip("\ufffd")


def test_streaming_sends_every_token_then_done(client: httpx.Client) -> None:
    expected = complete(client, prompt=[9, 10, 11], max_tokens=8, ignore_eos=True).json()
    events = []
    with client.stream("POST", "/v1/completions",
                       json={"temperature": 0, "prompt": [9, 10, 11], "max_tokens": 8,
                             "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    # a chunk a step's output, or what a stream fell behind on (test_stream_coalescing)
    assert all(c["choices"][0]["token_ids"] for c in chunks)
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == expected["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


def test_streamed_text_holds_back_incomplete_characters(client: httpx.Client,
                                                        loop: EngineLoop) -> None:
    """Every event's text so far is the decoded tokens so far less only U+FFFDs at its end: a
    character still incomplete is held back, so no U+FFFD is sent for bytes that a later token
    completes. (A stream behind its engine gets many tokens in one event; then a U+FFFD of
    bytes already known to be invalid may go out before the character still in progress.)"""
    decode = loop.engine.tokenizer.decode
    with client.stream("POST", "/v1/completions",
                       json={"temperature": 0, "prompt": [200, 201], "max_tokens": 48,
                             "ignore_eos": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert sum(len(chunk["choices"][0]["token_ids"]) for chunk in chunks) == 48
    tokens: list[int] = []
    text = ""
    for chunk in chunks:
        tokens += chunk["choices"][0]["token_ids"]
        text += chunk["choices"][0]["text"]
        whole = decode(tokens)
        assert whole.startswith(text) and not whole[len(text):].strip("\ufffd"), (text, whole)
    assert text.rstrip("\ufffd") == decode(tokens).rstrip("\ufffd")


def test_incomplete_utf8_is_held_back_until_it_completes() -> None:
    """"é" is two bytes, two tokens of the byte tokenizer: nothing after the first, the
    whole character after the second; an invalid byte mid-text stays visible as U+FFFD."""
    tokenizer = ByteTokenizer(320)
    texts = Texts(tokenizer.decode, SamplingParams())
    choice = Choice(0, [])
    streamed = []
    for token in [0xFF + ByteTokenizer.OFFSET, *tokenizer.encode("aé")]:
        choice.add(RequestOutput("x", (token,), False, None, "DECODING"))
        streamed.append(texts.delta(choice))
    assert streamed == ["", "\ufffda", "", "é"]


def test_openai_client_works(server: ServerThread) -> None:
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in api.models.list().data] == [MODEL]
    result = api.completions.create(model=MODEL, prompt="The budget", max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 4
    stream = api.completions.create(model=MODEL, prompt="The budget", max_tokens=4, stream=True,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == result.choices[0].text


def test_metrics_parse_with_vllm_names_and_buckets(client: httpx.Client) -> None:
    complete(client, prompt=[1, 2, 3], max_tokens=3, ignore_eos=True)
    response = client.get("/metrics")
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "chunk_queue_length", "cache_pressure_ratio", "bandwidth_utilization_5s_avg"):
        assert families[f"tokenflow_{name}"].type == "gauge"
    for name in ("num_preemptions", "prompt_tokens", "generation_tokens", "slow_queries",
                 "requests_rejected", "requests_failed"):
        assert families[f"tokenflow_{name}"].type == "counter"
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "iteration_tokens_total", "budget_score"):
        assert families[f"tokenflow_{name}"].type == "histogram"
    ttft = families["tokenflow_time_to_first_token_seconds"].samples
    bounds = [float(s.labels["le"]) for s in ttft if s.name.endswith("_bucket")]
    assert bounds == [*TTFT_BUCKETS, float("inf")]
    generated = families["tokenflow_generation_tokens"].samples[0]
    assert generated.labels["model_name"] == MODEL and generated.value >= 3


def test_models_health_and_stats(client: httpx.Client, loop: EngineLoop) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    loop.pause()  # a pause is a pause: not "ok", and not an error either
    try:
        paused = client.get("/health")
        assert paused.status_code == 503 and paused.json()["status"] == "paused"
        assert "POST /v1/admin/resume" in paused.json()["detail"]
    finally:
        loop.resume()
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.get("/v1/stats").status_code == 401  # request ids: the admin token's
    stats = client.get("/v1/stats", headers=AUTH).json()
    assert stats["model"] == MODEL and "kv_usage" in stats and "requests" in stats


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": f"Basic {TOKEN}"}])
def test_admin_needs_the_right_token(client: httpx.Client, headers: dict[str, str]) -> None:
    assert client.get("/v1/admin/config", headers=headers).status_code == 401
    patched = client.patch("/v1/admin/config", headers=headers, json={"chunk_tile": 32})
    assert patched.status_code == 401 and patched.headers["www-authenticate"] == "Bearer"
    assert client.post("/v1/admin/pause", headers=headers).status_code == 401


def test_admin_tunes_live_and_names_a_bad_field(client: httpx.Client, loop: EngineLoop) -> None:
    before = client.get("/v1/admin/config", headers=AUTH).json()["config"]
    bad = client.patch("/v1/admin/config", headers=AUTH, json={"chunk_tile": 0})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "chunk_tile"
    fixed = client.patch("/v1/admin/config", headers=AUTH, json={"model": "x"})
    assert fixed.status_code == 422 and fixed.json()["error"]["param"] == "model"
    good = client.patch("/v1/admin/config", headers=AUTH, json={"max_prefill_chunks": 2})
    assert good.status_code == 200 and good.json()["config"]["max_prefill_chunks"] == 2
    restored = client.patch("/v1/admin/config", headers=AUTH,
                            json={"max_prefill_chunks": before["max_prefill_chunks"]})
    assert restored.status_code == 200


def test_admin_is_off_without_a_token(loop: EngineLoop) -> None:
    with ServerThread(create_app(loop, admin_token=None)) as bare, \
            httpx.Client(base_url=bare.url) as http:
        response = http.get("/v1/admin/config", headers={"Authorization": "Bearer anything"})
        assert response.status_code == 403
        assert "TOKENFLOW_ADMIN_TOKEN" in response.json()["error"]["message"]
        stats = http.get("/v1/stats")
        assert stats.status_code == 403 and "--public-stats" in stats.json()["error"]["message"]
    with ServerThread(create_app(loop, admin_token=None, public_stats=True)) as public, \
            httpx.Client(base_url=public.url) as http:
        assert http.get("/v1/stats").json()["model"] == MODEL
        assert http.get("/v1/slow_queries").status_code == 404  # no store behind this one


def test_circuit_breaker_answers_422_before_engine_work(client: httpx.Client,
                                                        loop: EngineLoop) -> None:
    added = loop.engine.metrics.prompt_tokens_total
    response = complete(client, prompt=[7] * 77, max_tokens=4)  # 77 > 64 × 1.2
    assert response.status_code == 422
    error = response.json()["error"]
    assert "circuit breaker" in error["message"] and error["param"] == "prompt"
    assert complete(client, prompt=[7] * 76, max_tokens=1).status_code == 200
    assert loop.engine.metrics.prompt_tokens_total == added + 76  # the refused one never entered


@pytest.mark.parametrize(("content", "status"), [
    (b"{not json", 400), (b"[1, 2]", 400), (b'{"max_tokens": 4}', 400),
    (b'{"prompt": "hi", "max_tokens": "four"}', 400), (b'{"prompt": "hi", "max_tokens": 0}', 400),
    (b'{"prompt": "hi", "temperature": -1}', 400), (b'{"prompt": [1, "a"]}', 400),
    (b'{"prompt": []}', 400), (b'{"prompt": [999999]}', 400), (b'{"prompt": "hi", "n": 0}', 400),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404),
])
def test_malformed_requests_are_refused(client: httpx.Client, content: bytes,
                                        status: int) -> None:
    response = client.post("/v1/completions", content=content,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["message"]


def test_body_over_the_limit_gets_413(client: httpx.Client) -> None:
    body = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    json_type = {"Content-Type": "application/json"}
    assert client.post("/v1/completions", content=body, headers=json_type).status_code == 413

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield body[:1000]
        yield body[1000:]

    assert client.post("/v1/completions", content=chunked(),
                       headers=json_type).status_code == 413


def test_full_queue_gets_429_with_retry_after(loop: EngineLoop) -> None:
    app = create_app(loop, admin_token=None, max_queue=2)
    loop.pause()
    try:
        with ServerThread(app) as small, httpx.Client(base_url=small.url, timeout=30) as http:
            body = {"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as first, \
                    http.stream("POST", "/v1/completions", json=body) as second:
                assert first.status_code == second.status_code == 200  # both admitted
                refused = http.post("/v1/completions", json={**body, "stream": False})
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "1"
                loop.resume()
                for accepted in (first, second):
                    assert list(accepted.iter_lines())[-2] == "data: [DONE]"
            assert http.post("/v1/completions", json=body).status_code == 200
    finally:
        loop.resume()


@pytest.fixture
def aborted(loop: EngineLoop) -> Iterator[tuple[threading.Event, list[Finished]]]:
    """Set when the engine finishes a request as aborted (events arrive on its thread)."""
    seen, finished = threading.Event(), []

    def watch(event: Event) -> None:
        if isinstance(event, Finished) and event.reason == "aborted":
            finished.append(event)
            seen.set()

    unsubscribe = loop.engine.bus.subscribe(watch)
    yield seen, finished
    unsubscribe()


def test_stream_disconnect_aborts_the_request(
        client: httpx.Client, aborted: tuple[threading.Event, list[Finished]]) -> None:
    seen, finished = aborted
    body = {"prompt": [5, 6], "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["token_ids"]
    assert seen.wait(30), "the server did not abort the stream of a departed client"
    assert finished[0].generated_tokens < 1800


def test_disconnect_while_waiting_aborts_the_request(
        server: ServerThread, aborted: tuple[threading.Event, list[Finished]]) -> None:
    seen, finished = aborted
    body = json.dumps({"prompt": [5, 6], "max_tokens": 1800, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert seen.wait(30), "the server did not abort the request of a departed client"
    assert finished[0].generated_tokens < 1800


def test_admin_token_comes_from_a_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_admin_token() is None
    monkeypatch.setenv(TOKEN_ENV, " from-env \n")
    assert load_admin_token() == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert load_admin_token(token_file) == "from-file"
    token_file.write_text("\n")
    with pytest.raises(EngineError, match="empty"):
        load_admin_token(token_file)
    with pytest.raises(EngineError, match="cannot read"):
        load_admin_token(tmp_path / "missing")
    # set but empty is a mistake, as an empty file is, not "admin off"
    monkeypatch.setenv(TOKEN_ENV, " \n")
    with pytest.raises(EngineError, match=r"\$TOKENFLOW_ADMIN_TOKEN is set but empty; put the "
                                          r"admin token in it, or unset it"):
        load_admin_token()


def test_serve_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-queue", "0", "--no-db"]) == 2
    assert "--max-queue must be at least 1" in capsys.readouterr().err


def test_a_dead_engine_gets_503_with_retry_after(loop: EngineLoop) -> None:
    dead = EngineLoop(loop.engine)  # never started: stands for a loop whose thread crashed
    dead.error = RuntimeError("CUDA error: device lost")
    with ServerThread(create_app(dead, admin_token=None)) as down, \
            httpx.Client(base_url=down.url) as http:
        response = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert "device lost" in response.json()["error"]["message"]
        assert http.get("/health").status_code == 503


def test_serve_on_a_taken_port_says_so_before_loading_any_model(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = main(["serve", "--port", str(port), "--no-db",
                     "--model", str(tmp_path / "never-loaded")])
    assert code == 2
    assert (f"cannot listen on 127.0.0.1:{port}: Address already in use; choose another --port"
            in capsys.readouterr().err)
