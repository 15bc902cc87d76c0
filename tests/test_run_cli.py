"""`tokenflow run`: headless runs, JSONL in and out, clear errors."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from console.cli.engine_flags import engine_config
from console.cli.main import build_parser, main
from console.cli.run import RUN_BUDGET
from engine import Engine, EngineConfig, SamplingParams
from engine.store import open_database
from engine.store.models import JournalRow
from tests.mounts import remount, tmpfs
from tests.stores import damaged_store


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


def test_a_batch_run_takes_vllms_offline_budget_and_serving_keeps_the_engines() -> None:
    parser = build_parser()
    assert engine_config(parser.parse_args(["run"])).max_num_batched_tokens == RUN_BUDGET == 4096
    assert engine_config(parser.parse_args(
        ["run", "--max-num-batched-tokens", "256"])).max_num_batched_tokens == 256
    serving = engine_config(parser.parse_args(["serve"]))
    assert serving.max_num_batched_tokens == EngineConfig().max_num_batched_tokens == 256


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


# --- one writer, whole output lines, a journal that stops the run ------------------------

RUN_FLAGS = ["--model", "synthetic:tiny", "--device", "cpu", "--max-num-batched-tokens", "64"]


def _requests(path: Path, count: int, seed: int = 5) -> dict[str, list[int]]:
    """`count` requests written to `path`; returns the tokens an undisturbed run gives each."""
    rng = random.Random(seed)
    rows = [{"id": f"q{i:02d}", "prompt_token_ids": [rng.randrange(3, 300)
                                                     for _ in range(rng.randrange(8, 40))],
             "max_tokens": rng.randrange(20, 40)} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu"))
    return {r["id"]: engine.generate([r["prompt_token_ids"]],
                                     SamplingParams(max_tokens=r["max_tokens"]))[0]
            for r in rows}


def _outputs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]  # each line parses


def _journal(db: Path) -> dict[str, tuple[str, list[int]]]:
    database = open_database(db, read_only=True)
    try:
        with database.session() as session:
            return {row.request_id: (row.state, row.generated_token_ids)
                    for row in session.scalars(select(JournalRow))}
    finally:
        database.close()


@pytest.mark.slow  # two runs of tokenflow run
def test_a_second_run_on_one_db_is_refused_at_once_and_the_first_stays_exact(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, db = tmp_path / "in.jsonl", tmp_path / "j.db"
    expected = _requests(source, 12)
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first = subprocess.Popen([sys.executable, "-m", "console.cli.main", "run", *RUN_FLAGS,
                              "--requests", str(fifo), "--output", str(tmp_path / "one.jsonl"),
                              "--db", str(db)], env=env, stderr=subprocess.PIPE)
    # The first run takes the store, loads its model, then waits to read its requests: once
    # it opens the pipe it holds the lock, and it holds it until we have written them.
    with fifo.open("wb") as pipe:
        code = main(["run", *RUN_FLAGS, "--requests", str(source), "--output",
                     str(tmp_path / "two.jsonl"), "--db", str(db)])
        err = capsys.readouterr().err
        pipe.write(source.read_bytes())
    assert code == 2 and f"pid {first.pid}" in err and "run" in err and str(fifo) in err
    assert "in use by another writer" in err and not (tmp_path / "two.jsonl").exists()
    assert first.wait() == 0, first.stderr.read().decode()
    first.stderr.close()
    lines = _outputs(tmp_path / "one.jsonl")
    assert {line["id"]: line["token_ids"] for line in lines} == expected and len(lines) == 12
    assert _journal(db) == {rid: ("FINISHED", tokens) for rid, tokens in expected.items()}


def test_a_torn_last_line_is_set_aside_before_resume_appends(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    expected = _requests(source, 4)
    first = next(iter(expected))
    output.write_text(json.dumps({"id": first, "token_ids": expected[first]}) + "\n"
                      + '{"id": "q01", "token_i')  # killed (or out of disk) mid-line
    assert main(["run", *RUN_FLAGS, "--requests", str(source), "--output", str(output),
                 "--db", str(tmp_path / "j.db"), "--resume"]) == 0
    assert "ended with a cut-short line" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl.torn").read_text() == '{"id": "q01", "token_i\n'
    lines = _outputs(output)
    assert sorted(line["id"] for line in lines) == sorted(expected)
    assert {line["id"]: line["token_ids"] for line in lines} == expected


def test_a_full_disk_then_resume_gives_every_request_once_on_whole_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, db = tmp_path / "in.jsonl", tmp_path / "j.db"
    expected = _requests(source, 60)  # ~9 KB of output lines on a 4 KB filesystem
    with tmpfs(tmp_path / "disk", "4k") as disk:
        output = disk / "out.jsonl"
        args = ["run", *RUN_FLAGS, "--requests", str(source), "--output", str(output),
                "--db", str(db)]
        assert main(args) == 2
        assert "No space left on device" in capsys.readouterr().err
        remount(disk, "size=1m")  # space freed
        assert main([*args, "--resume"]) == 0
        assert "ended with a cut-short line" in capsys.readouterr().err  # cut by ENOSPC
        lines = _outputs(output)
    assert sorted(line["id"] for line in lines) == sorted(expected)  # each exactly once
    assert {line["id"]: line["token_ids"] for line in lines} == expected


def test_a_store_missing_its_journal_stops_the_run_at_start_with_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Start-up reads the journal for orphans, so the run stops before its first request
    (a journal that stops mid-run: the serve and console tests)."""
    db = tmp_path / "j.db"
    open_database(db).close()
    with contextlib.closing(sqlite3.connect(db)) as connection:
        connection.execute("DROP TABLE request_journal")  # the schema says head; it is not
    assert main(["run", *RUN_FLAGS, "--workload", "mixed", "--num-requests", "4", "--rate",
                 "inf", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "no such table: request_journal" in err and f"tokenflow db upgrade --db {db}" in err
    assert "Traceback" not in err and "requests ·" not in err  # no request ran


@pytest.mark.parametrize("command", [["run", *RUN_FLAGS, "--workload", "mixed",
                                      "--num-requests", "2", "--resume", "--quiet"],
                                     ["serve", "--port", "0", *RUN_FLAGS]])
def test_a_store_with_corrupt_pages_is_one_line(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = damaged_store(tmp_path / "damaged.db")
    assert main([*command, "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert f"{db} is not a SQLite database or is corrupt" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("content", "message"), [
    (b'{"id": "a", "prompt": "hi", "max_tokens": 2, "arrival_s": Infinity}\n',
     "in.jsonl:1: field 'arrival_s': must be a number of seconds in [0, 1e+06]"),
    (b'{"id": "a", "prompt": "hi", "max_tokens": 2}\n'
     b'{"id": "b", "prompt": "hi", "max_tokens": 2, "arrival_s": 1e300}\n',
     "in.jsonl:2: field 'arrival_s'"),
    (b'{"id": "a", "prompt": "caf\xe9", "max_tokens": 2}\n', "in.jsonl:1: not valid UTF-8"),
    (b'{"id": "a", "prompt": "x\\ud800", "max_tokens": 2}\n',
     "in.jsonl:1: field 'prompt': holds a lone surrogate"),
    (b'{"id": "a", "prompt": "x", "max_tokens": 2, "priority": 100000000000000000000000}\n',
     "in.jsonl:1: field 'priority': must be an integer in [-2^63, 2^63)"),
])
def test_bad_request_files_are_one_line_naming_the_line(
        content: bytes, message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(content)
    assert main(["run", *RUN_FLAGS, "--requests", str(source), "--no-db", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_run_reports_cold_start_to_first_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "synthetic:tiny", "--workload", "mixed", "--num-requests",
                 "2", "--rate", "inf", "--json", "--no-db", "--no-compile"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compile_s"] == 0.0
    assert summary["cold_start_s"] > 0
    assert summary["attention"].startswith("CPU backends (")  # chosen where the kernels build
    breakdown = summary["cold_start"]
    assert set(breakdown) == {"import_s", "kernels_s", "model_load_s", "attention_s",
                              "peaks_s", "kv_cache_s", "backends_s", "compile_s",
                              "first_calibration_s", "session_other_s", "to_first_token_s",
                              "total_s"}
    assert breakdown["total_s"] == pytest.approx(summary["cold_start_s"], abs=1e-3)
    parts = sum(value for key, value in breakdown.items() if key != "total_s")
    assert parts == pytest.approx(breakdown["total_s"], abs=0.01)


@pytest.mark.slow  # compiles synthetic:tiny
def test_run_compiles_with_a_progress_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "synthetic:tiny", "--workload", "mixed", "--num-requests",
                 "2", "--rate", "inf", "--json", "--no-db", "--compile"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "compiling the model" in captured.err and "compiled and warmed up" in captured.err
    assert 0 < summary["compile_s"] < summary["cold_start_s"]


@pytest.mark.slow  # two runs of tokenflow run
def test_prefix_caching_can_be_turned_off_from_the_command_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    def summary(*flags: str) -> dict[str, Any]:
        code = main(["run", "--model", "synthetic:tiny", "--workload", "multiturn",
                     "--num-requests", "4", "--rate", "inf", "--json", "--no-db", "--quiet",
                     *flags])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    cached, plain = summary(), summary("--no-prefix-caching")
    assert cached["prefix_cache_hits"] > 0  # on by default: the turns resend their history
    assert plain["prefix_cache_queries"] == plain["prefix_cache_hits"] == 0
    assert plain["prefill_tokens_computed"] > cached["prefill_tokens_computed"]
    # vLLM's spelling says the same
    assert summary("--no-enable-prefix-caching")["prefix_cache_queries"] == 0


def test_the_console_takes_the_prefix_caching_flag_for_its_own_engine_only() -> None:
    from console.cli.console import build_parser, conflict

    parse = build_parser().parse_args
    assert parse([]).enable_prefix_caching is None  # the engine's default: on
    assert parse(["--no-prefix-caching"]).enable_prefix_caching is False
    assert conflict(parse(["--no-prefix-caching"])) is None
    assert "prefix-caching" in conflict(parse(["--no-prefix-caching", "--attach", "http://x"]))


def test_the_console_refuses_flags_its_chosen_source_would_drop(tmp_path: Path) -> None:
    from console.cli.console import build_parser, conflict
    from console.sources.base import SourceError
    from console.sources.replay import ReplaySource, SessionRecorder

    parse = build_parser().parse_args
    assert conflict(parse(["--workload", "chat", "--rate", "3"])) is None
    for source in (["--attach", "http://x"], ["--replay", str(tmp_path / "r.jsonl")]):
        assert "--workload configure the embedded engine" in conflict(
            parse([*source, "--workload", "chat"]))
    assert conflict(parse(["--speed", "2"])) == ("--speed paces a recorded session; add "
                                                 "--replay FILE")
    assert conflict(parse(["--replay", "f.jsonl", "--speed", "0"])) is None
    for speed in ("nan", "inf", "-1", "1e+300"):
        with pytest.raises(SourceError, match=rf"replay speed must be in \[0, 10000\] "
                                              rf"\(0 steps a snapshot a refresh\), got "
                                              rf"{re.escape(speed)}"):
            ReplaySource(tmp_path / "r.jsonl", speed=float(speed))
    for flag in ("--slo-ttft-ms", "--slo-itl-ms"):
        for value in ("inf", "1e300", "0"):
            said = conflict(parse([flag, value]))
            assert said is not None and said.startswith(
                f"{flag} must be a number of milliseconds in (0, 86,400,000], a day at most")
    # a recording is a new file: never over an old one, never through a symlink
    old = tmp_path / "old.jsonl"
    old.write_text("kept\n")
    assert conflict(parse(["--record", str(old)])) == (
        f"--record {old} exists; choose another --record, or move the old recording away")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    assert "is a symlink" in conflict(parse(["--record", str(tmp_path / "link.jsonl")]))
    assert conflict(parse(["--record", str(tmp_path / "new.jsonl")])) is None
    assert conflict(parse(["--record", str(tmp_path / "no" / "new.jsonl")])) == (
        f"--record {tmp_path / 'no' / 'new.jsonl'}: no directory {tmp_path / 'no'}; create it "
        "first")
    with pytest.raises(FileExistsError):
        SessionRecorder(old)  # and were the file made meanwhile, the recorder still refuses
    assert old.read_text() == "kept\n"
