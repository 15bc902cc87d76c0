"""`tokenflow bench` end to end on a tiny model: the DESIGN.md JSON, baselines, report."""

from __future__ import annotations

import gc
import itertools
import json
import weakref
from collections.abc import Callable
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
                 "--capacity",
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


@pytest.mark.parametrize(("configs", "compare", "said"), [
    (["x:slow_query_threshold=3"], "chunked", "--config defines x, which --compare does not "
                                              "run; add it to --compare or drop the --config"),
    (["x:slow_query_threshold=3", "x:slow_query_threshold=4"], "x",
     "--config defines x twice; give one --config NAME all its fields"),
    (["unchunked:slow_query_threshold=3"], "unchunked",
     "--config 'unchunked:slow_query_threshold=3': unchunked is a built-in configuration"),
    (["x:budget=3"], "x", "budget: unknown configuration field; the fields a running engine "
                          "takes: auto_budget, auto_tpot_ms"),
])
def test_a_config_definition_that_would_be_dropped_is_refused(
        configs: list[str], compare: str, said: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A --config --compare never ran, one defined twice (the last won) and one named as a
    built-in (unchunked:x=1 ran chunked with x) were each dropped without a word."""
    code = main(["bench", "--model", "synthetic:8b", "--simulate", "h100", "--workload", "chat",
                 "--num-requests", "3", "--compare", compare,
                 *[arg for spec in configs for arg in ("--config", spec)]])
    assert code == 2
    assert said in capsys.readouterr().err


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


def _llama_like(tmp_path: Path, layers: int) -> Path:
    """A local model directory of a Llama-shaped config (hidden 8,192) with `layers` layers."""
    directory = tmp_path / f"llama-{layers}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": layers, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}))
    return directory


def test_a_gpu_twin_refuses_a_context_its_kv_pool_cannot_hold_as_vllm_does(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """43 layers of a 70B's width are 69.5 GiB of weights: one H100 at vLLM's default 0.9
    starts them (not at this CPU engine's 0.85, which the twin must not apply first), with
    KV for about 3,000 tokens, so vLLM would not start at the model's 4,096."""
    model = str(_llama_like(tmp_path, 43))
    argv = ["bench", "--simulate", "h100", "--model", model, "--input-len", "100",
            "--output-len", "2", "--num-prompts", "2", "--compare", "chunked", "--db",
            str(tmp_path / "s.db")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "one request of 4,096 tokens (the model's max_position_embeddings" in err
    assert "1 x H100 SXM at gpu_memory_utilization 0.9 leave" in err
    holds = int(err.split("Pass --max-model-len ")[1].split()[0])
    assert 2048 < holds < 4096
    assert main([*argv, "--max-model-len", str(holds)]) == 0
    assert "vLLM's GPU server defaults applied: gpu_memory_utilization=0.9" in (
        capsys.readouterr().out)


@pytest.mark.parametrize("kv_bytes, said", [
    ("1", "--kv-cache-bytes 1 hold 0.00 GiB, 0 tokens, and vLLM would not start. Raise "
          "--kv-cache-bytes"),
    ("100000000", "--kv-cache-bytes 100,000,000 hold 0.09 GiB, 752 tokens, and vLLM would not "
                  "start. Pass --max-model-len 752 or less, or raise --kv-cache-bytes"),
])
def test_a_kv_pool_given_in_bytes_is_the_one_a_refusal_names(
        kv_bytes: str, said: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The pool --kv-cache-bytes sets is no share of the GPU: only more bytes or a shorter
    context help, and no context fits a pool of no block."""
    assert main(["bench", "--simulate", "h100", "--model", "synthetic:8b", "--kv-cache-bytes",
                 kv_bytes, "--input-len", "10", "--output-len", "2", "--num-prompts", "2",
                 "--db", str(tmp_path / "s.db")]) == 2
    err = capsys.readouterr().err
    assert said in err and "gpu_memory_utilization" not in err, err


@pytest.mark.parametrize("rate", ["0", "-1", "nan", "-inf", "fast"])
def test_a_rate_that_is_not_positive_is_refused_at_every_door(
        rate: str, capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.console import build_parser

    flag = f"--rate={rate}"  # "-inf" after a space reads as a flag
    for argv in (["bench", "--simulate", "h100", "--model", "synthetic:8b", "--input-len",
                  "10", "--output-len", "2", flag],
                 ["bench", "--simulate", "h100", "--model", "synthetic:8b", flag],
                 ["run", "--model", "synthetic:tiny", flag]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert f"argument --rate: arrivals per second must be a number > 0, or inf to send " \
               f"all at once; got '{rate}'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args([flag])  # the console's
    assert "argument --rate" in capsys.readouterr().err


def _bench_requests(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                    *flags: str) -> tuple[int, str, list[float]]:
    code = main(["bench", "--simulate", "h100", "--model", "synthetic:8b", "--compare",
                 "chunked", "--db", str(tmp_path / "s.db"), "--json", "--quiet", *flags])
    out, err = capsys.readouterr()
    if code:
        return code, err, []
    report = json.loads(out)
    return code, err, [report["workload"]["duration_s"]]


def test_flags_with_nothing_to_shape_name_themselves_and_rate_paces_a_requests_file(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fixed = ["--input-len", "10", "--output-len", "2", "--num-prompts", "3"]
    for extra, named in ((["--time-scale", "2"], "--time-scale shapes"),
                         (["--length-scale", "1"], "--length-scale shapes"),
                         (["--workload", "mixed"], "--workload shapes"),
                         (["--num-requests", "5", "--time-scale", "1"],
                          "--num-requests, --time-scale shape")):
        code, err, _ = _bench_requests(capsys, tmp_path, *fixed, *extra)
        assert code == 2 and f"{named} a named workload" in err, err
        assert "drop" in err
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"id": f"r{n}", "prompt_token_ids": [5, 6, 7],
                                         "max_tokens": 2}) + "\n" for n in range(20)))
    code, _, at_once = _bench_requests(capsys, tmp_path, "--requests", str(plain))
    assert code == 0 and at_once == [0.0]
    code, _, paced = _bench_requests(capsys, tmp_path, "--requests", str(plain), "--rate", "4")
    # 19 Poisson gaps at 4/s: about 4.75 s, far from all at once
    assert code == 0 and 1.5 < paced[0] < 15
    assert _bench_requests(capsys, tmp_path, "--requests", str(plain), "--rate", "4")[2] == paced
    reseeded = _bench_requests(capsys, tmp_path, "--requests", str(plain), "--rate", "4",
                               "--workload-seed", "7")[2]
    assert reseeded != paced
    code, err, _ = _bench_requests(capsys, tmp_path, "--requests", str(plain),
                                   "--workload-seed", "7")
    assert code == 2 and "--workload-seed draws a requests file's arrivals only with --rate" in err
    code, err, _ = _bench_requests(capsys, tmp_path, "--requests", str(plain), "--num-requests",
                                   "3")
    assert code == 2 and "--num-requests shapes a named workload, and --requests" in err
    timed = tmp_path / "timed.jsonl"
    timed.write_text(plain.read_text() + json.dumps(
        {"id": "late", "prompt_token_ids": [5], "max_tokens": 2, "arrival_s": 3.0}) + "\n")
    code, err, _ = _bench_requests(capsys, tmp_path, "--requests", str(timed), "--rate", "4")
    assert code == 2 and f"{timed}:21 sets its own arrival_s" in err
    code, err, _ = _bench_requests(capsys, tmp_path, "--workload", f"traced:{tmp_path}/t.db",
                                   "--length-scale", "2")
    assert code == 2 and "--length-scale does not apply to traced:DB" in err
    code, err, _ = _bench_requests(capsys, tmp_path, "--workload", "nope")
    assert code == 2 and err.rstrip().endswith("code, trace:PATH, traced:DB")  # every door's


def _never(what: str) -> Callable[..., None]:
    """A stand-in for a step that must not come before the flags are checked."""
    def called(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{what} before the flags were checked")
    return called


def test_run_refuses_a_requests_files_idle_flags_before_the_model_loads(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from console.cli import run

    monkeypatch.setattr(run, "start_session", _never("the model loaded"))
    requests = tmp_path / "r.jsonl"
    requests.write_text('{"id": "a", "prompt_token_ids": [1, 2], "max_tokens": 2, '
                        '"arrival_s": 1.0}\n')
    for extra, said in ((["--workload", "chat"], "--workload shapes a named workload"),
                        (["--rate", "3"], "r.jsonl:1 sets its own arrival_s"),
                        (["--workload-seed", "1"], "only with --rate")):
        assert main(["run", "--model", "synthetic:tiny", "--no-db", "--requests",
                     str(requests), *extra]) == 2
        assert said in capsys.readouterr().err


def test_a_tuning_flag_without_what_it_tunes_is_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ["bench", "--simulate", "h100", "--model", "synthetic:8b", "--input-len", "10",
            "--output-len", "2", "--num-prompts", "2", "--compare", "chunked", "--db",
            str(tmp_path / "s.db")]
    for extra, said in ((["--capacity-duration", "3"], "--capacity-duration tune the "
                                                       "capacity search; add --capacity"),
                        (["--capacity-metric", "tbt", "--capacity-iterations", "2"],
                         "--capacity-iterations, --capacity-metric tune"),
                        (["--capacity-requests", "4"], "add --capacity"),
                        (["--hf-batch-size", "4"], "add hf to --compare"),
                        (["--router", "session"], "add --replicas N"),
                        (["--router", "session", "--replicas", "1"], "add --replicas N")):
        assert main([*base, *extra]) == 2
        assert said in capsys.readouterr().err
    assert main([*base, "--router", "session", "--replicas", "2", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["chunked"]["finished"] == 2


def test_a_simulated_run_refuses_the_flags_only_a_real_runner_reads(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from console.cli.console import build_parser, conflict

    base = ["bench", "--simulate", "h100", "--model", "synthetic:8b", "--input-len", "10",
            "--output-len", "2", "--num-prompts", "2", "--compare", "chunked", "--db",
            str(tmp_path / "s.db")]
    for extra, named in ((["--device", "cuda"], "--device configure"),
                         (["--cpu-threads", "4", "--seed", "3"], "--seed, --cpu-threads "
                                                                 "configure"),
                         (["--no-compile"], "--[no-]compile configure"),
                         (["--attention-backend", "paged", "--cpu-graphs"],
                          "--attention-backend, --[no-]cpu-graphs configure")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert named in err and "add --against-real" in err
    assert "--device places the model's weights" in conflict(
        build_parser().parse_args(["--simulate", "h100", "--device", "cuda"]))


def test_a_report_directory_that_holds_a_report_is_refused_before_the_runs(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "engine_config", _never("the runs started"))
    (tmp_path / "report.md").write_text("last week's\n")
    assert main(["bench", "--model", "synthetic:tiny", "--report", str(tmp_path)]) == 2
    assert (f"--report {tmp_path} holds report.md already; choose a new directory, or move "
            "the old report away") in capsys.readouterr().err
    assert (tmp_path / "report.md").read_text() == "last week's\n"
    assert main(["bench", "--model", "synthetic:tiny", "--report",
                 str(tmp_path / "report.md")]) == 2
    assert "is a file; name a directory" in capsys.readouterr().err
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "itl_cdf.png").symlink_to(tmp_path / "elsewhere.png")
    assert main(["bench", "--model", "synthetic:tiny", "--report", str(tmp_path / "d")]) == 2
    assert "holds itl_cdf.png already" in capsys.readouterr().err
    # a directory under a file cannot be made: refused before the runs, not after them
    assert main(["bench", "--model", "synthetic:tiny", "--report",
                 str(tmp_path / "report.md" / "sub" / "dir")]) == 2
    assert (f"{tmp_path / 'report.md'} is a file, so no directory can be made under it"
            in capsys.readouterr().err)


def test_a_report_that_cannot_be_written_keeps_the_runs_figures(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing fails after the runs (a full disk, a read-only mount): their table is printed,
    then the error, exit 1; nothing the runs measured is lost."""
    import console.cli.report as report

    def full_disk(*_: object) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_report", full_disk)
    assert main(["bench", "--model", "synthetic:8b", "--simulate", "h100", "--workload",
                 "chat", "--num-requests", "3", "--report", str(tmp_path / "r")]) == 1
    out, err = capsys.readouterr()
    assert "chunked" in out and "time:" in out
    assert (f"cannot write the report into {tmp_path / 'r'} (No space left on device); the "
            "figures printed are the runs'") in err


def test_requests_paced_past_the_longest_span_are_refused_at_every_door(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"id": f"r{n}", "prompt_token_ids": [5, 6, 7],
                                         "max_tokens": 2}) + "\n" for n in range(3)))
    for given in (["--requests", str(plain)],
                  ["--input-len", "10", "--output-len", "2", "--num-prompts", "3"]):
        code, err, _ = _bench_requests(capsys, tmp_path, *given, "--rate", "1e-9")
        assert code == 2 and "past the 1e+06 s (11.6 days) a workload may span" in err, err
        assert "Traceback" not in err


@pytest.mark.parametrize("flag, value, said", [
    ("--capacity-duration", "inf", "--capacity-duration must be a number of seconds in "
                                   "[0, 1e+06], as a workload's span, got inf"),
    ("--capacity-duration", "nan", "got nan"),
    ("--capacity-duration", "1e9", "got 1000000000.0"),
    ("--capacity-duration", "-1", "got -1.0"),
    ("--capacity-iterations", "0", "--capacity-iterations must be at least 1 (a probe each)"),
    ("--capacity-requests", "0", "--capacity-requests must be at least 1, got 0"),
    # within the span, yet its fastest probe would draw tens of millions of requests
    ("--capacity-duration", "1e6", "requests/s for --capacity-duration 1e+06 s"),
    ("--capacity-requests", "200000", "would send 200000 requests, past the 100000 one run "
                                      "holds; lower them"),
])
def test_a_capacity_search_that_could_not_end_or_probe_is_refused(
        flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """inf and nan crashed the probe's request count; 1e9 s of steady traffic ran on
    unbounded; no iteration gave a capacity of 0 from no probe; a probe of more requests than
    a workload may hold was drawn before it ran."""
    assert main(["bench", "--simulate", "h100", "--model", "synthetic:8b", "--workload", "chat",
                 "--num-requests", "4", "--capacity", flag, value, "--compare", "chunked",
                 "--db", str(tmp_path / "s.db")]) == 2
    assert said in capsys.readouterr().err



@pytest.mark.parametrize("extra, said", [
    (["--compare", ""], "--compare '' names no configuration; give one or more of chunked"),
    (["--compare", " , "], "--compare ' , ' names no configuration"),
    (["--compare", "chunked,auto,chunked"], "--compare names chunked twice; a configuration "
                                            "runs once"),
    (["--config", "x:max_model_len=100", "--compare", "x"],
     "max_model_len is fixed at an engine's start, so every configuration of a bench shares "
     "it; set it with --max-model-len"),
    (["--config", "x:gpu_memory_utilization=0.5", "--compare", "x"],
     "set it with --gpu-memory-utilization"),
    (["--config", "x:stats_window_s=5", "--compare", "x"], "a bench does not set it"),
])
def test_a_comparison_of_nothing_or_of_start_time_fields_is_refused_with_the_fix(
        extra: list[str], said: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """An empty --compare ran nothing and exited 0 beside an empty table; a start-time field
    in --config said "restart the engine", which a bench's user cannot do."""
    assert main(["bench", "--simulate", "h100", "--model", "synthetic:8b", "--input-len", "8",
                 "--output-len", "2", "--num-prompts", "2", "--db", str(tmp_path / "s.db"),
                 *extra]) == 2
    assert said in capsys.readouterr().err


def test_against_real_refuses_a_model_this_host_cannot_hold_before_the_twin_runs(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The real runs beside the twin load the model here: one that does not fit ended the
    bench after the twin's runs, and its refusal said to use the twin the user was using."""
    import engine.model.loader as loader
    monkeypatch.setattr(loader, "free_memory", lambda device: (1_000, "this host"))
    assert main(["bench", "--model", "synthetic:tiny", "--simulate", "h100", "--workload",
                 "chat", "--num-requests", "3", "--against-real", "1"]) == 2
    out, err = capsys.readouterr()
    assert "synthetic:tiny needs about" in err and "this host has 0.0 GB available" in err
    assert err.rstrip().endswith("or drop --against-real to price it on the twin alone")
    assert "bench --simulate GPU" not in err and out == ""
