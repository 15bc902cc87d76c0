"""`tokenflow run`: headless runs, JSONL in and out, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from console.cli.main import main


def test_run_prints_a_json_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["run", "--model", "synthetic:tiny", "--workload", "mixed", "--num-requests",
                 "6", "--rate", "inf", "--json", "--db", str(tmp_path / "t.db")])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["finished"] == summary["requests"] == 6
    assert summary["output_tok_s"] > 0
    assert set(summary["ttft_ms"]) == {"p50", "p90", "p99"}


def test_run_reads_and_writes_jsonl(tmp_path: Path) -> None:
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"id": "a", "prompt": "hello", "max_tokens": 3}\n'
                        '{"id": "b", "prompt_token_ids": [5, 6, 7], "max_tokens": 2}\n')
    output = tmp_path / "out.jsonl"
    assert main(["run", "--model", "synthetic:tiny", "--requests", str(requests), "--output",
                 str(output), "--no-db"]) == 0
    lines = {row["id"]: row["token_ids"] for row in map(json.loads,
                                                         output.read_text().splitlines())}
    assert set(lines) == {"a", "b"} and 1 <= len(lines["b"]) <= 2


def test_run_with_a_missing_requests_file_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "synthetic:tiny", "--requests", str(tmp_path / "no.jsonl"),
                 "--no-db"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_run_with_a_bad_config_value_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "synthetic:tiny", "--max-num-batched-tokens", "0",
                 "--no-db"]) == 2
    assert "max_num_batched_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["bogus", "mps"])
def test_run_on_an_unknown_device_says_which_ones_work(
        device: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "synthetic:tiny", "--device", device, "--no-db"]) == 2
    assert f"device {device!r} is not supported; use auto, cpu, cuda or cuda:N" in (
        capsys.readouterr().err)


def test_a_rejected_request_is_written_with_its_reason_not_dropped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"id": "huge", "prompt_token_ids": [5] * 5000,
                                    "max_tokens": 3}) + "\n"
                        + json.dumps({"id": "fine", "prompt": "hello", "max_tokens": 2}) + "\n")
    output = tmp_path / "out.jsonl"
    assert main(["run", "--model", "synthetic:tiny", "--requests", str(requests), "--output",
                 str(output), "--no-db"]) == 0
    rows = {row["id"]: row for row in map(json.loads, output.read_text().splitlines())}
    assert rows["huge"]["error"]["state"] == "REJECTED"
    assert "shorten the prompt" in rows["huge"]["error"]["reason"]
    assert len(rows["fine"]["token_ids"]) == 2
    assert "request huge REJECTED: circuit breaker" in capsys.readouterr().err


def test_run_reports_cold_start_to_first_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "synthetic:tiny", "--workload", "mixed", "--num-requests",
                 "2", "--rate", "inf", "--json", "--no-db", "--no-compile"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compile_s"] == 0.0
    assert summary["cold_start_s"] > 0


@pytest.mark.slow  # compiles synthetic:tiny
def test_run_compiles_with_a_progress_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "synthetic:tiny", "--workload", "mixed", "--num-requests",
                 "2", "--rate", "inf", "--json", "--no-db", "--compile"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "compiling the model" in captured.err and "compiled and warmed up" in captured.err
    assert 0 < summary["compile_s"] < summary["cold_start_s"]
