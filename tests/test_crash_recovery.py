"""Kill `tokenflow run` with SIGKILL mid-prefill and mid-decode, resume, and get exactly the
outputs of a run that was never interrupted, none emitted twice (pitfall 12). The journal's
tests run on both stores, a SQLite file and a PostgreSQL database (`store_url`)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import ProgrammingError

from console.cli.main import main
from engine import Engine, EngineConfig, SamplingParams
from engine.events import EventBus, RequestAdded
from engine.harness.chaos import query_journal
from engine.harness.driver import OutputTokens
from engine.store import StoreWriter, open_database, quarantined_requests
from engine.store.recovery import Resumption, resume_unfinished
from tests.engine_runs import finish

FLAGS = ["--model", "synthetic:tiny", "--device", "cpu", "--max-num-batched-tokens", "8",
         "--chunk-tile", "8"]
# Enough work that each run is still going when it is killed, whatever the engine's speed:
# the kills wait for a journal commit that shows a prefill, then one that shows a decode.
# With 30 requests a faster engine once finished the resumed run before the journal showed a
# decode (CI); with 60 of 40-160 prompt tokens, an engine twice as fast again wrote ~7
# commits a run and showed a prefill in 2 (none in one CI run). 120 of 60-200: ~15 commits,
# 5-6 with a prefill and 7-8 with a decode.
REQUESTS = 120
PROMPT_TOKENS, MAX_TOKENS = (60, 200), (12, 40)


def _requests(path: Path) -> list[dict]:
    rng = random.Random(3)
    rows = [{"id": f"r{i:02d}", "prompt_token_ids": [rng.randrange(3, 300)
                                                     for _ in range(rng.randrange(*PROMPT_TOKENS))],
             "max_tokens": rng.randrange(*MAX_TOKENS)} for i in range(REQUESTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _undisturbed(rows: list[dict]) -> dict[str, list[int]]:
    """Each request's tokens from one engine that serves them all and is never killed."""
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu"))
    for r in rows:
        engine.add_request(r["prompt_token_ids"], SamplingParams(max_tokens=r["max_tokens"]),
                           request_id=r["id"])
    return finish(engine)


def _query(db: str, sql: str) -> list[tuple[object, ...]]:
    """Rows from another process's journal; [] while its schema does not exist yet."""
    if "://" not in db:
        return query_journal(Path(db), sql)
    engine = create_engine(db)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.exec_driver_sql(sql)]
    except ProgrammingError:
        return []
    finally:
        engine.dispose()


@pytest.mark.slow  # kills and restarts processes
def test_sigkill_mid_prefill_and_mid_decode_then_resume(tmp_path: Path, store_url: str) -> None:
    requests_file, output, db = tmp_path / "in.jsonl", tmp_path / "out.jsonl", store_url
    expected = _undisturbed(_requests(requests_file))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = [sys.executable, "-m", "console.cli.main", "run", *FLAGS, "--requests",
            str(requests_file), "--output", str(output), "--db", str(db), "--report-commits"]
    decoding = "SELECT 1 FROM request_journal WHERE generated_tokens > 0 AND state = 'DECODING'"
    # killed on the journal's own commit lines: the state acted on is on disk, no polling
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    mid_prefill = _kill_on_line(first, first.stdout, lambda line: '"prefilling": ["' in line)
    second = subprocess.Popen([*args, "--resume"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    mid_decode = _kill_on_line(second, second.stdout,
                               lambda line: bool(_query(db, decoding)))
    assert mid_prefill and mid_decode, "the run finished before it could be killed"
    subprocess.run([*args, "--resume"], env=env, capture_output=True, check=True)

    lines = [json.loads(line) for line in output.read_text().splitlines()]
    ids = [line["id"] for line in lines]
    assert len(ids) == len(set(ids)) == REQUESTS
    assert {line["id"]: line["token_ids"] for line in lines} == expected


def _kill_on_line(process: subprocess.Popen[bytes], stream: IO[bytes],
                  wanted: Callable[[str], bool]) -> str | None:
    """SIGKILL `process` as soon as it writes a line `wanted` accepts to `stream` (read as it
    comes, no polling); that line, or None if it ended first."""
    for raw in iter(stream.readline, b""):
        line = raw.decode()
        if wanted(line):
            process.send_signal(signal.SIGKILL)
            process.wait()
            return line
    process.wait()
    return None


@pytest.mark.slow  # kills and restarts processes
def test_a_resume_killed_right_after_it_says_so_loses_nothing(tmp_path: Path) -> None:
    """The resume is committed before "resumed N" is said, so a kill
    right after it leaves the same requests for the next resume (it said "resumed 0")."""
    requests_file, output, db = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "j.db"
    expected = _undisturbed(_requests(requests_file))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = [sys.executable, "-m", "console.cli.main", "run", *FLAGS, "--requests",
            str(requests_file), "--output", str(output), "--db", str(db)]

    first = subprocess.Popen([*args, "--report-commits"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    assert _kill_on_line(first, first.stdout, lambda line: '"prefilling": ["' in line)
    second = subprocess.Popen([*args, "--resume"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    said = _kill_on_line(second, second.stderr, lambda line: line.startswith("resumed "))
    assert said is not None
    resumed = int(said.split()[1])
    assert resumed > 0
    third = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True,
                           check=True)
    again = int(third.stderr.split("resumed ", 1)[1].split()[0])
    assert 0 < again <= resumed  # the killed resume's requests are found again
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == sorted(expected)
    assert {line["id"]: line["token_ids"] for line in lines} == expected


def _journal_three_unfinished(db_path: str | Path) -> dict[str, list[int]]:
    """Three requests journaled mid-flight by an engine that then stopped (as if killed);
    returns the tokens an undisturbed run gives each."""
    prompts = {"a": [5, 6, 7, 8] * 10, "b": [9, 10, 11] * 12, "c": [12, 13] * 20}
    params = SamplingParams(max_tokens=12)
    expected = {rid: Engine(EngineConfig(model="synthetic:tiny", device="cpu")).generate(
        [prompt], params)[0] for rid, prompt in prompts.items()}
    database = open_database(db_path)
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                 max_num_batched_tokens=16))
    writer = StoreWriter(database, engine.bus)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=rid)
    for _ in range(4):
        engine.step()
    assert writer.close()
    database.close()
    return expected


def _resume_and_abandon(db_path: str | Path) -> Resumption:
    """What `serve` does on start (resume the journal), then dies before its first step."""
    database = open_database(db_path)
    try:
        return resume_unfinished(Engine(EngineConfig(model="synthetic:tiny", device="cpu")),
                                 database)
    finally:
        database.close()


@pytest.mark.slow  # kills and restarts processes
def test_serve_resume_killed_at_once_loses_nothing_then_quarantines(
        store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    db = store_url
    expected = _journal_three_unfinished(db)
    # serve has no requests file to recompute from: the journal alone must keep them
    assert _resume_and_abandon(db).resumed == ("a", "b", "c")
    assert _resume_and_abandon(db).resumed == ("a", "b", "c")
    # died in two runs that resumed them: quarantined, not run a third time
    third = _resume_and_abandon(db)
    assert third.resumed == () and third.quarantined == ("a", "b", "c")
    assert _resume_and_abandon(db).quarantined == ()  # kept, not counted again

    assert main(["slow-queries", "list", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "quarantined requests (3)" in out and "release-quarantine" in out
    assert main(["db", "release-quarantine", "b", "--db", str(db)]) == 0
    assert main(["db", "release-quarantine", "nope", "--db", str(db)]) == 2
    assert "no quarantined request 'nope'" in capsys.readouterr().err

    database = open_database(db)
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu"))
    writer = StoreWriter(database, engine.bus)
    try:
        resumption = resume_unfinished(engine, database)
        assert resumption.resumed == ("b",)  # the operator's word
        tokens, outputs = OutputTokens(resumption.generated), {}
        while engine.has_unfinished():
            for o in engine.step():
                held = tokens.add(o)
                if o.finished:
                    outputs[o.request_id] = held
        assert writer.close()
        with database.session() as session:
            assert [q.request_id for q in quarantined_requests(session)] == ["a", "c"]
    finally:
        database.close()
    assert outputs == {"b": expected["b"]}


def test_an_entry_the_engine_refuses_is_failed_once_not_resumed_at_every_start(
        tmp_path: Path) -> None:
    database = open_database(tmp_path / "old.db")
    bus = EventBus()
    writer = StoreWriter(database, bus)
    for rid, sampling in (("refused", {"max_tokens": -1}), ("fine", {"max_tokens": 2})):
        bus.publish(RequestAdded(request_id=rid, prompt_token_ids=(5, 6, 7), sampling=sampling,
                                 tenant="t"))
    bus.drain()
    assert writer.close()
    database.close()
    first = _resume_and_abandon(tmp_path / "old.db")
    assert first.failed == ("refused",) and first.resumed == ("fine",)
    assert _resume_and_abandon(tmp_path / "old.db").failed == ()  # closed FAILED, for good
