"""`tokenflow bench` end to end on a tiny model: the DESIGN.md JSON, baselines, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from console.cli.main import main


def test_bench_json_runs_every_configuration_and_writes_a_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--model", "synthetic:tiny", "--workload", "mixed",
                 "--num-requests", "5", "--rate", "50", "--compare", "chunked,unchunked,auto,hf",
                 "--config", "small:max_num_batched_tokens=32", "--capacity",
                 "--capacity-requests", "3", "--capacity-duration", "0",
                 "--capacity-iterations", "1", "--json",
                 "--report", str(tmp_path)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"workload", "machine", "runs", "slo", "capacity"}
    assert list(report["runs"]) == ["chunked", "unchunked", "auto", "hf"]
    for name, run in report["runs"].items():
        for key in ("config", "requests", "throughput_tok_s", "output_tok_s", "ttft_ms",
                    "tpot_ms", "itl_ms", "step_ms", "preemptions", "slow_queries",
                    "prefill_mfu", "decode_mbu", "goodput"):
            assert key in run, (name, key)
        assert run["finished"] == 5
    assert report["runs"]["unchunked"]["config"]["chunked_prefill"] is False
    assert report["runs"]["auto"]["config"]["auto_budget"] is True
    assert report["runs"]["chunked"]["prefill_mfu"] > 0
    for name in ("report.md", "ttft_cdf.png", "tpot_cdf.png", "predicted_vs_measured.png",
                 "capacity.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_bench_rejects_an_unknown_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", "synthetic:tiny", "--compare", "fastest"]) == 2
    assert "unknown configuration 'fastest'" in capsys.readouterr().err


def test_bench_rejects_a_bad_config_field(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--model", "synthetic:tiny", "--config", "x:cache_low_watermark=2"])
    assert code == 2
    assert "cache_" in capsys.readouterr().err


def test_bench_rejects_a_negative_capacity_duration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", "synthetic:tiny", "--capacity",
                 "--capacity-duration", "-1"]) == 2
    assert "--capacity-duration" in capsys.readouterr().err


def test_bench_multiturn_shows_what_the_prefix_cache_saves(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--model", "synthetic:tiny", "--workload", "multiturn",
                 "--num-requests", "3", "--rate", "inf", "--time-scale", "0.001",
                 "--compare", "chunked,nocache", "--json"])
    assert code == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    cached, plain = runs["chunked"], runs["nocache"]
    assert plain["config"]["enable_prefix_caching"] is False
    assert cached["finished"] == plain["finished"] == 3 * 4
    assert plain["hit_rate"] is None and cached["hit_rate"] > 0.5
    assert cached["prefix_cache_queries"] >= cached["prefix_cache_hits"] > 0
    assert cached["prefill_tokens_computed"] < plain["prefill_tokens_computed"] / 2
