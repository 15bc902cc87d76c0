"""`tokenflow bench` end to end on a tiny model: the DESIGN.md JSON, baselines, report."""

from __future__ import annotations

import gc
import itertools
import json
import weakref
from pathlib import Path

import pytest

from console.cli import bench
from console.cli.main import main
from console.cli.report import cdf_figure
from engine import Engine, EngineConfig
from engine.harness.workload import WorkloadRequest


@pytest.mark.slow  # a bench of every configuration
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
    for name in ("report.md", "ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png",
                 "predicted_vs_measured.png", "capacity.png"):
        assert (tmp_path / name).stat().st_size > 0
    slo = report["slo"]
    assert 0 < slo["ttft_ms"]["min"] <= slo["ttft_ms"]["max"]
    markdown = (tmp_path / "report.md").read_text()
    assert "ITL p50 ms | ITL p99 ms" in markdown and "![itl_cdf.png](itl_cdf.png)" in markdown
    assert f"TPOT and ITL ≤ {slo['tpot_ms']:.1f} ms" in markdown
    assert f"scheduling delay ≤ {slo['scheduling_delay_ms']:.1f} ms" in markdown
    assert "for the shortest prompt" in markdown and "for the longest" in markdown
    run = report["runs"]["chunked"]
    assert f"| {run['itl_ms']['p50']:.1f} | {run['itl_ms']['p99']:.1f} |" in markdown


@pytest.mark.parametrize("values", [[0.4, 0.9, 3.0, 12.0, 80.0, 2500.0, 40_000.0],
                                    [11.0, 12.5, 14.0, 19.0], [150.0, 900.0, 1800.0]])
def test_report_cdf_has_few_readable_log_ticks_and_labelled_slo_lines(
        values: list[float]) -> None:
    figure, axes = cdf_figure("TTFT", {"chunked": values}, [(20.0, "TTFT SLO 20 ms")])
    figure.canvas.draw()
    low, high = axes.get_xlim()
    labels = [t for t in axes.get_xticklabels()
              if t.get_text() and low <= t.get_position()[0] <= high]
    assert 2 <= len(labels) <= 8
    assert all(t.get_text().endswith((" ms", " s")) for t in labels)  # in a unit, not 10^x
    boxes = sorted((t.get_window_extent() for t in labels), key=lambda box: box.x0)
    assert all(a.x1 < b.x0 for a, b in itertools.pairwise(boxes))  # none overlaps the next
    assert not [t for t in axes.xaxis.get_minorticklabels() if t.get_text()]
    [slo] = [line for line in axes.get_lines() if line.get_label() == "TTFT SLO 20 ms"]
    assert list(slo.get_xdata()) == [20.0, 20.0]
    assert "TTFT SLO 20 ms" in axes.get_legend_handles_labels()[1]


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


@pytest.mark.slow  # two bench runs
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


@pytest.mark.slow  # several bench runs
def test_a_bench_run_frees_the_engines_of_the_runs_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bench builds an engine per run; whether or not a dropped engine's parts refer to
    each other, the next run has freed its weights and KV pool."""
    built: list[weakref.ref[Engine]] = []

    def engine(config: EngineConfig) -> Engine:
        built.append(weakref.ref(made := Engine(config)))
        return made

    monkeypatch.setattr(bench, "Engine", engine)
    config = EngineConfig(model="synthetic:tiny", device="cpu")
    workload = [WorkloadRequest("r0", 0.0, (1, 2, 3), 2, ignore_eos=True)]
    gc.collect()
    gc.disable()  # only the bench's own collection may free them
    try:
        bench._run("chunked", config, workload, 1, None)
        bench._run("chunked", config, workload, 1, None)
        assert built[0]() is None
    finally:
        gc.enable()


def test_an_unknown_flag_prints_the_subcommands_usage(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--model", "synthetic:tiny", "--no-db"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tokenflow bench ")
    assert "tokenflow bench: error: unrecognized arguments: --no-db" in err


def test_identical_chunked_and_unchunked_rows_say_why_and_columns_have_units(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--simulate", "h100", "--model", "synthetic:tiny", "--workload",
                 "chat", "--num-requests", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("config"))
    assert out[header + 1].split() == ["tok/s", "tok/s", "ms", "ms", "ms", "ms", "ms", "ms",
                                       "count", "count", "share", "tokens", "share"]
    assert any(line.startswith("note: chunked and unchunked are identical: the longest "
                               "prompt (") for line in out)
